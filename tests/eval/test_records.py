"""The record store both ``run_eval`` and ``run_sweep`` resume from: whole-line appends, torn lines."""

from __future__ import annotations

import json
import logging

import pytest

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
    assert "results.jsonl: skipping the unreadable (torn) line 2" in caplog.text


def test_an_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path, caplog):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "torn')
    RecordStore(path).add({"id": "b"})  # the piece is redone and appended
    assert path.read_text() == '{"id": "a"}\n{"id": "b", "torn\n{"id": "b"}\n'
    with caplog.at_level(logging.WARNING, logger="kvquant.eval"):
        assert [r["id"] for r in read_records(path)] == ["a", "b"]
    assert "line 2" in caplog.text


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
