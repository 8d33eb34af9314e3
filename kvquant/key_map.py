"""Key maps: a calibrated linear map per KV head that puts key quantization error where queries
do not look.

A score's error is ``q . e`` for a key error ``e``. The quantizers spread their error evenly over a
head's channels (after the Hadamard rotation), and each vector's error grows with its norm, so for a
linear map ``M`` applied to the keys before quantizing (and ``M^-T`` to the query, which keeps every
score exact) the expected squared score error is proportional to

    ``tr(M C M^T) * tr(M^-T Q M^-1)``

where ``C`` is the second moment of the (smoothed) keys and ``Q`` that of the queries. The least of
it over all ``M`` is reached where ``M^T M`` is the geometric mean ``C^-1 # Q`` (the identity, the
rotation alone, is optimal only when ``C`` and ``Q`` are proportional). :func:`fit_key_map` returns
``M = (C^-1 # Q)^(exponent / 2)``, normalized to determinant 1: ``exponent`` 1 is that optimum,
smaller values move part of the way from the identity (0.75 measured best on SmolLM2). ``C`` and
``Q`` are weighted by how much each key and query matters to the attention output (``kvquant
calibrate --key-map`` in :mod:`kvquant.tools.calibrate`: each key by the squared attention it gets
times its value's distance from the output).

A map changes what is stored, never what attention computes: the cache stores ``R M (k - mean)``,
the ``kvquant`` attention folds ``M^-T`` into the query and the dequantizing path applies ``M^-1``
(:class:`kvquant.transforms.KeyTransform`). A map calibrated on another model of the same shapes
still gives exact attention, only a different error. Maps are a model's constants (shared by every
cache, like the weights; not counted in a cache's bytes).

Files: ``torch.save({"format": "kvquant-key-map", "version": 1, "maps": {layer: [H, D, D]},
"meta": {...}})``. ``key_map:`` in a config takes a path or the name of a map shipped in
``kvquant/configs/key_maps/`` (``smollm2``: the embedded model, calibrated on the embedded corpus).

Example:
    >>> c = torch.diag(torch.tensor([4.0, 1.0])).expand(1, 2, 2)   # keys: wide on channel 0
    >>> q = torch.diag(torch.tensor([1.0, 4.0])).expand(1, 2, 2)   # queries: on channel 1
    >>> fit_key_map(c, q, exponent=1.0)[0].diag()                   # shrink channel 0, widen 1
    tensor([0.7071, 1.4142])
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path
from typing import Any

import torch

FILE_FORMAT = "kvquant-key-map"
FILE_VERSION = 1
DEFAULT_EXPONENT = 0.75
_RIDGE = 1e-4  # of the mean eigenvalue, added to C and Q: a direction never seen is not blown up


def _power(a: torch.Tensor, p: float) -> torch.Tensor:
    """``a^p`` of symmetric positive definite ``a [..., D, D]`` (float64)."""
    e, u = torch.linalg.eigh(a)
    return (u * (e.clamp_min(torch.finfo(a.dtype).tiny) ** p)[..., None, :]) @ u.transpose(-1, -2)


def fit_key_map(c: torch.Tensor, q: torch.Tensor, exponent: float = DEFAULT_EXPONENT) -> torch.Tensor:
    """The key map ``M [H, D, D]`` (fp32, symmetric, determinant 1) of key second moments
    ``c [H, D, D]`` and query second moments ``q [H, D, D]`` (one per KV head, its query heads
    summed): ``(c^-1 # q)^(exponent / 2)`` (see the module docstring). ``exponent`` in ``[0, 1]``;
    0 gives the identity."""
    if c.shape != q.shape or c.dim() != 3 or c.shape[-1] != c.shape[-2]:
        raise ValueError(f"c, q: expected two [H, D, D], got {tuple(c.shape)} and {tuple(q.shape)}")
    if not 0.0 <= exponent <= 1.0:
        raise ValueError(f"exponent: expected a value in [0, 1], got {exponent}")
    d = c.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)

    def ridged(a: torch.Tensor) -> torch.Tensor:
        a = a.double()
        a = (a + a.transpose(-1, -2)) / 2
        mean_eig = torch.diagonal(a, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None, None]
        return a + _RIDGE * mean_eig * eye

    c, q = ridged(c), ridged(q)
    ch, chi = _power(c, 0.5), _power(c, -0.5)
    geo = chi @ _power(ch @ q @ ch, 0.5) @ chi  # c^-1 # q
    m = _power((geo + geo.transpose(-1, -2)) / 2, exponent / 2)
    m = m / torch.linalg.det(m).clamp_min(1e-300)[:, None, None] ** (1.0 / d)
    return m.float()


def save_key_map(path: str | Path, maps: dict[int, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    """Write ``{layer: M [H, D, D]}`` (stored as fp16) as a key map file."""
    data = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "maps": {int(i): m.detach().to(torch.float16).cpu().contiguous() for i, m in maps.items()},
        "meta": dict(meta or {}),
    }
    torch.save(data, Path(path))


def shipped_key_maps() -> list[str]:
    """Names of the key maps shipped with the package (``kvquant/configs/key_maps/*.pt``)."""
    d = importlib.resources.files("kvquant.configs") / "key_maps"
    if not d.is_dir():
        return []
    return sorted(p.name[: -len(".pt")] for p in d.iterdir() if p.name.endswith(".pt"))


def key_map_path(spec: str) -> Path:
    """The file a config's ``key_map`` names: a shipped map's name, else a path."""
    if spec in shipped_key_maps():
        return Path(str(importlib.resources.files("kvquant.configs") / "key_maps" / f"{spec}.pt"))
    return Path(spec)


def load_key_map(spec: str | Path) -> dict[int, torch.Tensor]:
    """``{layer: M [H, D, D]}`` (fp32) of a key map file or shipped name; ``ValueError`` naming the
    file when it is missing, not a key map, or holds a map that is not finite and invertible. The
    result is shared (memoised per resolved path and modification time): do not modify it."""
    path = key_map_path(str(spec))
    if not path.is_file():
        shipped = ", ".join(shipped_key_maps()) or "none"
        raise ValueError(f"key_map: no such key map file {str(spec)!r} (shipped maps: {shipped})")
    stat = path.stat()
    return _load(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> dict[int, torch.Tensor]:
    where = f"key_map: {path!r}"
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file: one line, not torch's unpickling trace
        raise ValueError(f"{where} is not a kvquant key map file ({type(exc).__name__})") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FILE_FORMAT
        or not isinstance(data.get("maps"), dict)
    ):
        raise ValueError(f"{where} is not a kvquant key map file (made by `kvquant calibrate --key-map`)")
    if data.get("version") != FILE_VERSION:
        raise ValueError(
            f"{where}: version {data.get('version')!r}; this kvquant reads version {FILE_VERSION}"
        )
    maps = {}
    for layer, m in data["maps"].items():
        if not isinstance(m, torch.Tensor) or m.dim() != 3 or m.shape[-1] != m.shape[-2]:
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{where}: layer {layer} holds {shape}; expected [kv_heads, head_dim, head_dim]")
        m = m.float()
        if not torch.isfinite(m).all() or bool((torch.linalg.det(m.double()).abs() < 1e-12).any()):
            raise ValueError(f"{where}: layer {layer}'s map is not finite and invertible")
        maps[int(layer)] = m
    return maps


def layer_map(maps: dict[int, torch.Tensor], layer: int, spec: str) -> torch.Tensor:
    """Layer ``layer``'s map (``ValueError`` naming the file when it has none)."""
    if layer not in maps:
        raise ValueError(f"key_map: {spec!r} has no map for layer {layer} (it holds layers {sorted(maps)})")
    return maps[layer]
