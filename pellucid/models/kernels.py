"""pellucid's C kernels (unpack.c, rowdot.c, lm_head.c, decode_attention.c), built for this CPU
at first use into one shared library in pellucid's cache, named after their sources and the CPU's
flags; and their torch ops (ops.cpp: rowdot's products, the int4 LM head and decode attention),
built where they are the fast path.

They are compiled with the machine's C compiler (-O3 -march=native, about a second) and OpenMP:
linked by soname to libgomp.so.1, the library resolves to the copy torch has loaded already, so
its parallel loops share torch's threads instead of starting a second pool that would fight
them for the cores. Where no compiler (or no OpenMP) is found, `library()` is None and the
layers fall back on torch's kernels (see models/quant.py). The torch ops also need a C++
compiler and torch's headers; without them, rowdot.py calls the kernels from Python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from pellucid.atomic import atomic_path
from pellucid.cpu import cpu_flags
from pellucid.weights.cache import cache_root

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # in the libraries' names, not compiled
OPS_NAMES = ("ops.cpp", "rowdot.c", "lm_head.c", "decode_attention.c")
OPS_SOURCES = [Path(__file__).with_name(name) for name in OPS_NAMES]
log = logging.getLogger("pellucid")

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# each C function's arguments (see the sources)
SIGNATURES = {
    "int4_to_dense_t": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "int4_dot_to_dense": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _int],
    "int8_to_dense": [_ptr, _ptr, _ptr, _i64, _i64, _int],
    "int4_rows_mm": [_ptr, _int, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64],
    "int5_rows_mm": [_ptr, _int, _ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64],
    "int8_rows_mm": [_ptr, _int, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64],
    "int4_head_mm": [_ptr, _int, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64],
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built now if this machine has not built them yet; None if they cannot be."""
    path = cache_root() / "kernels" / f"pellucid-{_key(SOURCES)}.so"
    try:
        if not path.exists():
            _build(path, SOURCES)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build pellucid's C kernels (%s): torch's kernels are used", e)
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    return lib


@functools.cache
def torch_ops() -> bool:
    """Load the kernels' torch ops, built now if need be: True, or False where they cannot be
    built (rowdot.py then keeps its Python implementation, paged_attention.py its tensor code)."""
    torch_dir = Path(torch.__file__).parent
    key = _key(OPS_SOURCES, torch.__version__, str(torch_dir))
    path = cache_root() / "kernels" / f"pellucid-ops-{key}.so"
    link = ("-I", str(torch_dir / "include"), "-L", str(torch_dir / "lib"), "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}")  # fmt: skip
    try:
        if not path.exists():
            _build(path, OPS_SOURCES, link)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build pellucid's torch ops (%s): slower paths are used", e)
        return False
    return True


def _key(sources: list[Path], *extra: str) -> str:
    h = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *HEADERS]))
    h.update(" ".join([*sorted(cpu_flags()), *extra]).encode())
    return h.hexdigest()[:16]


def _build(path: Path, sources: list[Path], extra: tuple[str, ...] = ()) -> None:
    command = [os.environ.get("CC", "cc"), "-O3", "-march=native", "-shared", "-fPIC"]
    with atomic_path(path) as tmp:
        for openmp in (["-fopenmp"], []):  # without OpenMP, the loops run in one thread
            try:
                subprocess.run([*command, *openmp, "-o", str(tmp), *map(str, sources), *extra],
                               check=True, timeout=300, capture_output=True)  # fmt: skip
                return
            except subprocess.CalledProcessError:
                if not openmp:
                    raise
