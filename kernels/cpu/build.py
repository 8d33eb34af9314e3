"""Build and load the C kernels (``decode_cpu.c``, ``quantize_cpu.c``, ``rotate_cpu.c`` and their header ``kvq_common.h``
beside this file): compiled at first use, into one library loaded via ctypes.

The shared library is compiled once per machine with ``$CC`` (default ``cc``) and
``-O3 -march=native`` into ``<cache_root>/native/`` (see :func:`kvquant.env.cache_root`), named
by a hash of the sources, the flags, the compiler's version and the CPU model, and loaded from there
afterwards (a second process reuses it; an interrupted build leaves nothing half-written). Without a
compiler, when the build fails or with ``KVQUANT_NATIVE=0`` there is no library and the ops take
the torch backends, with the same numbers.

Example:
    >>> from kvquant.kernels.cpu import native_available
    >>> native_available()          # False without a C compiler
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvquant.env import c_compiler, cache_root, native_enabled

log = logging.getLogger("kvquant")

SOURCES = tuple(Path(__file__).parent / name for name in ("decode_cpu.c", "quantize_cpu.c", "rotate_cpu.c"))
HEADERS = (Path(__file__).parent / "kvq_common.h",)
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")

_state: dict[str, object] = {}  # "lib": the loaded library, or "error": why there is none


class Operand(ctypes.Structure):
    """Mirror of ``kvq_operand`` in decode_cpu.c."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("code_sb", ctypes.c_int64),
        ("code_sh", ctypes.c_int64),
        ("code_st", ctypes.c_int64),
        ("scale", ctypes.c_void_p),
        ("scale_sb", ctypes.c_int64),
        ("scale_sh", ctypes.c_int64),
        ("scale_st", ctypes.c_int64),
        ("zero", ctypes.c_void_p),
        ("zero_sb", ctypes.c_int64),
        ("zero_sh", ctypes.c_int64),
        ("zero_st", ctypes.c_int64),
        ("lut", ctypes.c_void_p),
        ("bits", ctypes.c_int32),
        ("is_signed", ctypes.c_int32),
        ("n_groups", ctypes.c_int32),
        ("channel_axis", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("scale_dtype", ctypes.c_int32),
        ("state_codes", ctypes.c_int32),
        ("fp8", ctypes.c_int32),
    ]


class Writer(ctypes.Structure):
    """Mirror of ``kvq_writer`` in quantize_cpu.c."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("csb", ctypes.c_int64),
        ("csh", ctypes.c_int64),
        ("cst", ctypes.c_int64),
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("ssb", ctypes.c_int64),
        ("ssh", ctypes.c_int64),
        ("sst", ctypes.c_int64),
        ("kind", ctypes.c_int32),
        ("scale_dtype", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("is_signed", ctypes.c_int32),
        ("n_groups", ctypes.c_int32),
        ("mant", ctypes.c_int32),
        ("bias", ctypes.c_int32),
        ("state_bits", ctypes.c_int32),
        ("n_grid", ctypes.c_int32),
        ("qmax", ctypes.c_float),
        ("levels", ctypes.c_void_p),
        ("grid", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("two_pass_from", ctypes.c_int64),
        ("block", ctypes.c_int64),
    ]


class FpRows(ctypes.Structure):
    """Mirror of ``kvq_fp`` in decode_cpu.c (a decode's full-precision tokens in segments, and the key
    smoothing)."""

    _fields_ = [
        ("k", ctypes.POINTER(Operand)),
        ("v", ctypes.POINTER(Operand)),
        ("len", ctypes.POINTER(ctypes.c_int64)),
        ("n_seg", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("valid", ctypes.c_void_p),
        ("mean", ctypes.c_void_p),
        ("std", ctypes.c_void_p),
    ]


class Step(ctypes.Structure):
    """Mirror of ``kvq_step`` in quantize_cpu.c (one decode step's append of a cache layer)."""

    _fields_ = [
        ("tail_k", ctypes.c_void_p),
        ("tail_v", ctypes.c_void_p),
        ("tsb", ctypes.c_int64),
        ("tsh", ctypes.c_int64),
        ("tst", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("mean", ctypes.c_void_p),
        ("std", ctypes.c_void_p),
        ("rot_scale", ctypes.c_float),
        ("first_threads", ctypes.c_int32),
        ("move_threads", ctypes.c_int32),
        ("scratch", ctypes.c_void_p),
        ("first_k", ctypes.POINTER(Writer)),
        ("first_v", ctypes.POINTER(Writer)),
        ("move_src_k", ctypes.POINTER(Operand)),
        ("move_src_v", ctypes.POINTER(Operand)),
        ("move_dst_k", ctypes.POINTER(Writer)),
        ("move_dst_v", ctypes.POINTER(Writer)),
    ]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, flags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile the source with ``flags`` unless a build with the same key exists; its path."""
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_model().encode()])
    ).hexdigest()[:16]
    out_dir = cache_root() / "native"
    target = out_dir / f"decode_cpu-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        run = subprocess.run(
            [cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if run.returncode != 0:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    """Open a built library and declare its entry points."""
    lib = ctypes.CDLL(str(path))
    p, i64, op = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(Operand)
    fn = lib.kvq_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [p, i64, i64, i64, i64, op, op, p, i64, ctypes.c_float, ctypes.c_float, p, p, ctypes.c_int]
    fn.argtypes += [ctypes.POINTER(FpRows), op, op, p, p, i64, ctypes.c_float]
    qz = lib.kvq_quantize
    qz.restype = ctypes.c_int
    qz.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, i64, i64, i64, p, p, i64, i64, i64]
    qz.argtypes += [ctypes.c_int] * 4 + [i64]
    head = [p, i64, i64, i64, i64, i64, i64, i64, p, i64, i64, i64]  # x, its shape and strides, codes
    cb = lib.kvq_quantize_codebook
    cb.restype = ctypes.c_int
    cb.argtypes = [*head, p, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, ctypes.c_int]
    cb.argtypes += [ctypes.c_float, ctypes.c_int]
    f8 = lib.kvq_quantize_fp8
    f8.restype = ctypes.c_int
    f8.argtypes = [*head, p, i64, i64, i64, *[ctypes.c_int] * 4, ctypes.c_float]
    tq = lib.kvq_quantize_trellis
    tq.restype = ctypes.c_int
    tq.argtypes = [*head, p, i64, i64, i64, *[ctypes.c_int] * 4, p, i64, ctypes.c_int]
    tr = lib.kvq_trellis_encode
    tr.restype = ctypes.c_int
    tr.argtypes = [p, i64, i64, p, ctypes.c_int, ctypes.c_int, i64, p, ctypes.c_int]
    dq = lib.kvq_dequantize
    dq.restype = None
    dq.argtypes = [op, i64, i64, i64, i64, i64, p]
    wr, i32 = ctypes.POINTER(Writer), ctypes.c_int
    kw = lib.kvq_write
    kw.restype = ctypes.c_int
    kw.argtypes = [wr, p, i64, i64, i64, i64, i64, i64, i64, i64, i32]
    tc = lib.kvq_transcode
    tc.restype = ctypes.c_int
    tc.argtypes = [op, i64, i64, i64, i64, i64, wr, i64, i32, i32]
    ro = lib.kvq_rotate
    ro.restype = None
    ro.argtypes = [p, i64, p, i64, i64, ctypes.c_float, ctypes.c_int]
    st = lib.kvq_append_step
    st.restype = ctypes.c_int
    st.argtypes = [ctypes.POINTER(Step), p, i64, i64, p, i64, i64, i64, i64, i64, i64, i64]
    rp = lib.kvq_rotate_pair
    rp.restype = None
    rp.argtypes = [p, i64, i64, i64, p, i64, i64, i64, i64, i64, i64, i64, p, p, ctypes.c_float, p]
    return lib


def library():
    """The loaded kernel library, or None (the reason is logged once and kept in ``_state``)."""
    if "lib" in _state or "error" in _state:
        return _state.get("lib")
    if not native_enabled():
        _state["error"] = "disabled by KVQUANT_NATIVE=0"
        return None
    cc = shutil.which(c_compiler())
    try:
        if cc is None:
            raise RuntimeError(f"no C compiler ({c_compiler()!r} not on PATH)")
        try:
            path = _build(cc)
        except RuntimeError:  # a compiler without OpenMP: one thread per call, same results
            path = _build(cc, tuple(f for f in CFLAGS if f != "-fopenmp"))
        _state["lib"] = _load(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _state["error"] = str(err)
        log.warning("kvquant: native CPU decode kernel unavailable, using the torch path: %s", err)
        return None
    return _state["lib"]


def native_available() -> bool:
    """Whether the native CPU decode kernel is built and loaded (builds it on first call)."""
    return library() is not None


def native_error() -> str | None:
    """Why the kernel is unavailable (None when it is loaded or not yet tried)."""
    return _state.get("error")
