"""The files of a results folder that make a run resumable: the record store and the folder's stamp.

``results.jsonl`` holds one JSON record per finished piece of work (a cache config in ``kvquant
eval``, a quality / memory / speed piece in a sweep), appended the moment it finishes. A rerun opens
the same :class:`RecordStore` and skips every record id it finds; only the rest is measured.

Appends are whole lines: a record is written as one ``write()`` of its JSON and a ``"\\n"``, then
flushed and fsynced. A process killed inside that write leaves at most one torn last line (no
``"\\n"`` at its end): the reader skips it with a warning (that piece is measured again), and the
next append starts on a fresh line, so the torn text never glues itself to a good record.

Example:
    >>> store = RecordStore(run_dir / "results.jsonl", key="id")
    >>> if "llama|int4@1a2b3c4d|memory|256|1" not in store:
    ...     store.add({"id": "llama|int4@1a2b3c4d|memory|256|1", "memory": {...}})
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvquant.eval")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, in order; unreadable (torn) lines are skipped with a warning."""
    records = []
    if not path.is_file():
        return records
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by an interruption: that piece is redone
            logger.warning("%s: skipping the unreadable (torn) line %d", path.name, i)
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one whole line (one ``write()``, then fsync); on a fresh line if the file
    does not end in ``"\\n"``."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordStore:
    """The records of one ``results.jsonl`` by id (the value of each record's ``key`` field).

    ``add`` appends a record whole and remembers it; ``in`` / ``get`` / ``records`` read what earlier
    runs and this one finished (the last record of an id wins).
    """

    def __init__(self, path: Path, key: str = "id"):
        self.path, self.key = Path(path), key
        self.records: dict[str, dict[str, Any]] = {r[key]: r for r in read_records(self.path) if key in r}

    def __contains__(self, rid: str) -> bool:
        return rid in self.records

    def get(self, rid: str) -> dict[str, Any] | None:
        return self.records.get(rid)

    def add(self, record: dict[str, Any]) -> None:
        append_record(self.path, record)
        self.records[record[self.key]] = record


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, replacing ``path`` atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def claim_folder(stamp: Path, identity: str, fingerprint: str, refusal: Exception) -> None:
    """Stamp a results folder with the identity of its settings; raise ``refusal`` when it already
    holds results of other settings (resuming those would mix numbers)."""
    if stamp.is_file() and json.loads(stamp.read_text()).get("identity") != identity:
        raise refusal
    write_json(stamp, {"identity": identity, "model_fingerprint": fingerprint or None})
