"""Corpora and windows.

Sources (``corpus.name``):

- ``embedded``: ``eval/data/embedded_corpus.txt``, prose written for this project (CC0), shipped
  with the package: works offline on a fresh machine (about 5,000 SmolLM2 tokens).
- ``wikitext2``: the raw WikiText-2 test split from the Hugging Face hub via ``datasets``, rows
  joined with ``"\\n\\n"`` (the usual perplexity protocol). When the hub cannot be reached it falls
  back, with a message, to a local copy of the split named by ``$KVQUANT_WIKITEXT2``, which is read
  as stored (rows already end in newlines).
- a local ``.txt`` file, read through ``datasets``' ``text`` builder with line breaks kept and joined
  with ``""``: the file exactly as stored; or a ``.jsonl`` / ``.json`` file, the ``text_field`` of each
  row joined with ``"\\n\\n"``. ``corpus.join`` overrides the separator.

The text is tokenized once, without special tokens, and cut into ``windows`` non-overlapping
windows of ``P + D`` tokens whose starts are evenly spaced over the token stream.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvquant.env import hub_offline, wikitext2_path
from kvquant.eval.config import CorpusSection, EvalError

logger = logging.getLogger(__name__)

WIKITEXT2_LOCAL = "wikitext-2-raw-test.txt"
_HUB_HOST = "huggingface.co"


@dataclass
class Corpus:
    text: str
    info: dict[str, Any]  # name, source, join, chars, sha256


def embedded_corpus_path() -> Path:
    return Path(str(importlib.resources.files("kvquant.eval") / "data" / "embedded_corpus.txt"))


def _local_wikitext2() -> Path | None:
    path = wikitext2_path()
    return path.resolve() if path is not None and path.is_file() else None


def _hub_reachable(timeout: float = 3.0) -> bool:
    if hub_offline():
        return False
    try:  # one DNS + TCP probe instead of `datasets`' ~25 s of retries when offline
        socket.create_connection((_HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_datasets(kind: str, path: Path, text_field: str, join: str) -> str:
    import datasets

    datasets.logging.set_verbosity_error()
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating test split" bars for a local file are noise
    kwargs = {"keep_linebreaks": True} if kind == "text" else {}
    try:
        ds = datasets.load_dataset(kind, data_files={"test": str(path)}, split="test", **kwargs)
    except Exception as exc:  # datasets raises many types for unreadable input
        raise EvalError(
            f"corpus: could not read {str(path)!r} with datasets ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if text_field not in ds.column_names:
        raise EvalError(
            f"corpus: {str(path)!r} has no column {text_field!r} (columns: {', '.join(ds.column_names)}); "
            "set corpus.text_field"
        )
    return join.join(str(t) for t in ds[text_field] if t is not None)


def _check_text_file(path: Path, jsonl: bool = False) -> None:
    """:class:`EvalError` naming the file (and line) when a local corpus is empty, not UTF-8 text, or
    (``.jsonl``) holds a line that is not a JSON object; ``datasets`` says only that generation failed."""
    import codecs
    import json

    if path.stat().st_size == 0:
        raise EvalError(f"corpus: {str(path)!r} is empty")
    decoder = codecs.getincrementaldecoder("utf-8")()
    line_no, pending = 0, ""
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                text = pending + decoder.decode(chunk)
            except UnicodeDecodeError:
                raise EvalError(f"corpus: {str(path)!r} is not UTF-8 text (a binary file?)") from None
            if not jsonl:
                continue
            *lines, pending = text.split("\n")
            for line in lines:
                line_no += 1
                _check_json_line(path, line_no, line, json)
    if jsonl and pending.strip():
        _check_json_line(path, line_no + 1, pending, json)


def _check_json_line(path: Path, line_no: int, line: str, json) -> None:
    if not line.strip():
        return
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise EvalError(f"corpus: {str(path)!r} line {line_no}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise EvalError(
            f"corpus: {str(path)!r} line {line_no}: expected a JSON object, got {type(row).__name__}"
        )


def load_corpus(section: CorpusSection) -> Corpus:
    """The text of a corpus (see the module docstring); :class:`EvalError` on bad input."""
    name = section.name
    if name == "embedded":
        path = embedded_corpus_path()
        if not path.is_file():
            raise EvalError(f"corpus: the embedded corpus {str(path)!r} is missing from this installation")
        text, source, join = path.read_text(encoding="utf-8"), str(path), "as stored"
    elif name == "wikitext2":
        text, source, join = _wikitext2(section)
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise EvalError(
                f"corpus: no such file {name!r}; use 'embedded', 'wikitext2', or a .txt / .jsonl / .json file"
            )
        suffix = path.suffix.lower()
        _check_text_file(path, jsonl=suffix == ".jsonl")
        if suffix in (".jsonl", ".json"):
            join = "\n\n" if section.join is None else section.join
            text = _from_datasets("json", path, section.text_field, join)
        else:
            join = "" if section.join is None else section.join
            text = _from_datasets("text", path, "text", join)
        source, join = str(path.resolve()), repr(join) if join else "as stored"
    if not text.strip():
        raise EvalError(f"corpus: {name!r} is empty")
    info = {
        "name": name,
        "source": source,
        "join": join,
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    return Corpus(text, info)


def _wikitext2(section: CorpusSection) -> tuple[str, str, str]:
    join = "\n\n" if section.join is None else section.join
    reason = "the Hugging Face hub is unreachable"
    if _hub_reachable():
        try:
            import datasets

            ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
            return join.join(ds["text"]), "hub:wikitext/wikitext-2-raw-v1/test", repr(join)
        except Exception as exc:  # network or hub errors of many types
            reason = f"loading it from the hub failed ({type(exc).__name__})"
    local = _local_wikitext2()
    if local is None:
        raise EvalError(
            f"corpus 'wikitext2': {reason} and no local copy was found; pass the file "
            f"(--corpus path/to/{WIKITEXT2_LOCAL}) or set KVQUANT_WIKITEXT2"
        )
    logger.warning("corpus 'wikitext2': %s; using the local copy %s (rows joined as stored)", reason, local)
    return local.read_text(encoding="utf-8"), str(local), "as stored"


# ------------------------------------------------------------------------------------------ tokens


class ByteTokenizer:
    """A tokenizer for tiny random models (vocab >= 128): one id per ASCII byte, ``?`` otherwise.

    It has the two methods the harness calls on any tokenizer: ``encode`` and ``decode``.
    """

    def __init__(self, vocab_size: int = 128):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b if b < 128 else ord("?") for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(i if 32 <= i < 128 or i in (9, 10) else ord("?") for i in ids).decode("ascii")


def tokenize(tokenizer: Any, text: str) -> torch.Tensor:
    """``[N]`` token ids of ``text``, no special tokens added."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than the model's maximum": we cut windows
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    finally:
        hf_logging.set_verbosity(level)
    return torch.tensor(ids, dtype=torch.long)


def make_windows(
    ids: torch.Tensor, prefix_len: int, score_len: int, windows: int, name: str = ""
) -> torch.Tensor:
    """``[windows, P + D]``: non-overlapping windows with evenly spaced starts."""
    size = prefix_len + score_len
    need = size * windows
    if ids.numel() < need:
        raise EvalError(
            f"corpus {name!r}: {ids.numel()} tokens, shorter than {windows} window(s) of "
            f"{prefix_len} + {score_len} tokens ({need} needed); use a longer corpus or smaller windows"
        )
    slack = ids.numel() - need
    starts = [i * size + (slack * i) // max(windows - 1, 1) for i in range(windows)]
    return torch.stack([ids[s : s + size] for s in starts])  # [W, P + D]
