"""The record store both ``run_eval`` and ``run_sweep`` resume from: whole-line appends, torn lines."""

from __future__ import annotations

import json
import logging

import pytest

from kvquant.eval.config import EvalError
from kvquant.eval.records import RecordStore, append_record, claim_folder, read_records


def test_records_round_trip_by_id(tmp_path):
    path = tmp_path / "results.jsonl"
    store = RecordStore(path, key="id")
    assert "a" not in store and store.records == {}
    store.add({"id": "a", "x": 1})
    store.add({"id": "b", "x": 2.5, "text": "Δppl"})
    assert path.read_text().count("\n") == 2 and path.read_text().endswith("\n")
    again = RecordStore(path, key="id")
    assert list(again.records) == ["a", "b"] and again.get("b")["text"] == "Δppl"
    assert RecordStore(path, key="key").records == {}  # records without the key field are not ids


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "results.jsonl"
    append_record(path, {"id": "a"})
    with path.open("a") as f:
        f.write('{"id": "b", "memo')  # the process was killed inside the write
    with caplog.at_level(logging.WARNING, logger="kvquant.eval"):
        store = RecordStore(path)
    assert list(store.records) == ["a"]
    assert "results.jsonl: skipping the unreadable (torn) last line 2" in caplog.text


def test_an_append_after_a_torn_line_cuts_the_torn_line_off(tmp_path, caplog):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "torn')
    with caplog.at_level(logging.WARNING, logger="kvquant.eval"):
        RecordStore(path).add({"id": "b"})  # the piece is redone and appended
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'  # no fragment left behind, no glued line
    assert "cutting off the torn last line" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvquant.eval"):
        assert [r["id"] for r in read_records(path)] == ["a", "b"]
    assert caplog.text == ""  # the file is whole again
    # a torn first (only) line, and one torn inside a multi-byte character, are cut off the same way
    path.write_bytes('{"id": "Δ'.encode()[:-1])
    append_record(path, {"id": "c"})
    assert path.read_text() == '{"id": "c"}\n'


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}')
    assert [r["id"] for r in read_records(path)] == ["a", "b"]
    append_record(path, {"id": "c"})
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n'


@pytest.mark.parametrize(
    "bad", ['{"id": "b", "to', "[1, 2]", "7", b"\xff\xfe garbage"], ids=["torn", "list", "number", "binary"]
)
def test_a_bad_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path, bad):
    path = tmp_path / "results.jsonl"
    bad = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(b'{"id": "a"}\n\n' + bad + b'\n{"id": "c"}\n')
    with pytest.raises(EvalError, match=r"results.jsonl: line 3 is not a JSON record"):
        RecordStore(path)


def test_an_unreadable_folder_stamp_is_an_error_naming_it(tmp_path):
    stamp = tmp_path / "run.json"
    stamp.write_bytes(b"\x00\x01")
    with pytest.raises(EvalError, match="run.json: unreadable"):
        claim_folder(stamp, "abc", "", ValueError("taken"))


def test_each_record_is_one_write_of_a_whole_line(tmp_path, monkeypatch):
    import os

    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(data) or real(fd, data))
    path = tmp_path / "results.jsonl"
    append_record(path, {"id": "a", "rows": list(range(2000))})
    append_record(path, {"id": "b"})
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
    assert [json.loads(w)["id"] for w in writes] == ["a", "b"]


def test_a_folder_of_other_settings_is_refused(tmp_path):
    stamp = tmp_path / "run.json"
    claim_folder(stamp, "abc", "", ValueError("taken"))
    claim_folder(stamp, "abc", "", ValueError("taken"))  # the same settings resume
    assert json.loads(stamp.read_text()) == {"identity": "abc", "model_fingerprint": None}
    with pytest.raises(ValueError, match="taken"):
        claim_folder(stamp, "xyz", "", ValueError("taken"))
