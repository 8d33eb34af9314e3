"""The files of a results folder that make a run resumable: the record store and the folder's stamp.

``results.jsonl`` holds one JSON record per finished piece of work (a cache config in ``kvquant
eval``, a quality / memory / speed piece in a sweep), appended the moment it finishes. A rerun opens
the same :class:`RecordStore` and skips every record id it finds; only the rest is measured.

Appends are whole lines: a record is written as one ``write()`` of its JSON and a ``"\\n"``, then
fsynced. A process killed inside that write leaves at most one torn last line (no ``"\\n"`` at its
end). The reader skips it with a warning (that piece is measured again); the next append cuts it off
(truncates the file back to the end of the last whole line) before writing, so the torn text neither
glues itself to the new record nor stays behind as a bad line in the middle. (A last line that is
whole JSON but lost only its ``"\\n"`` is kept, and terminated.) A line in the middle that is not a
JSON object is not an interruption's trace but a damaged file: reading it raises
:class:`~kvquant.eval.config.EvalError` naming the file and the line, rather than skipping records
or appending after them.

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

from kvquant.eval.config import EvalError

logger = logging.getLogger("kvquant.eval")


def _parse(line: bytes) -> dict[str, Any] | None:
    """The JSON object of one line, or None when it is not one (torn, damaged, not UTF-8)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, in order. A torn last line (no ``"\\n"``, not JSON) is
    skipped with a warning; a line in the middle that is not a JSON object raises :class:`EvalError`
    naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends in "\n"
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _parse(line)
        if record is None:
            raise EvalError(
                f"{path}: line {i} is not a JSON record (the file is damaged, not just cut short); "
                "fix or delete that line, or use another output folder"
            )
        records.append(record)
    if tail.strip():
        record = _parse(tail)
        if record is None:  # a line cut by an interruption: that piece is redone
            logger.warning("%s: skipping the unreadable (torn) last line %d", path.name, len(lines) + 1)
        else:
            records.append(record)
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one whole line (one ``write()``, then fsync). A torn last line (no
    ``"\\n"``, not JSON) is cut off first; a whole last record that lost its ``"\\n"`` is terminated."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            start = _line_start(fd, size)
            if _parse(os.pread(fd, size - start, start)) is None:
                logger.warning("%s: cutting off the torn last line before appending", Path(path).name)
                os.ftruncate(fd, start)
            else:
                line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def _line_start(fd: int, size: int, block: int = 1 << 16) -> int:
    """Offset just after the last ``"\\n"`` of the file (0 when it has none)."""
    end = size
    while end > 0:
        begin = max(0, end - block)
        i = os.pread(fd, end - begin, begin).rfind(b"\n")
        if i >= 0:
            return begin + i + 1
        end = begin
    return 0


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
    if stamp.is_file():
        try:
            found = json.loads(stamp.read_bytes().decode("utf-8"))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            found = None
        if not isinstance(found, dict):
            raise EvalError(
                f"{stamp}: unreadable (not the JSON this folder's runs write); delete it to reuse the "
                "folder, or use another output folder"
            )
        if found.get("identity") != identity:
            raise refusal
    write_json(stamp, {"identity": identity, "model_fingerprint": fingerprint or None})
