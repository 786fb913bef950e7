"""Packed weights unpacked to dense matrices by a small C kernel (unpack.c), built for this CPU at
first use: how a product of many rows (pre-fill) gets its matrix without a second copy of the
model kept in memory.

Why: a many-row product runs fastest as a dense GEMM (models/quant.py), but dense copies of
every packed matrix took more memory than the packed weights themselves (SmolLM2: 212 MB of
bf16 beside 67 MB of int4). Unpacked just before its product and dropped after it, a matrix
costs its bytes for the length of one product. That is cheap only as one fused loop: in torch
ops it takes eight passes over the matrix (nibbles, interleave, transpose, convert, scale,
shift) and longer than the 512-row product it feeds; the loop is bound by writing the dense
matrix out (timings: benchmarks/results/comments.md).

The kernel is compiled with the machine's C compiler (-O3 -march=native, under a second) into
pellucid's cache, named after its source and the CPU's flags. Where none runs, `available()` is
False and the layers keep dense copies, as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch
from torch import Tensor

from pellucid.atomic import atomic_path
from pellucid.cpu import cpu_flags
from pellucid.weights.cache import cache_root

SOURCE = Path(__file__).with_name("unpack.c")
log = logging.getLogger("pellucid")
# Per thread, one buffer per shape and dtype for matrices unpacked for a single product, rather
# than fresh pages to fault in for each. Per thread: two engines may pre-fill in two threads.
_scratch = threading.local()


@functools.cache
def _library() -> ctypes.CDLL | None:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(sorted(cpu_flags())).encode())
    path = cache_root() / "kernels" / f"unpack-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            with atomic_path(path) as tmp:
                command = [os.environ.get("CC", "cc"), "-O3", "-march=native", "-shared", "-fPIC"]
                subprocess.run([*command, "-o", str(tmp), str(SOURCE)], check=True, timeout=120,
                               capture_output=True)  # fmt: skip
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the unpacking kernel (%s): dense copies are kept", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int4_to_dense_t.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.int8_to_dense.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel is built (or could be built now)."""
    return _library() is not None


def int4_dense(
    packed: Tensor, scales_zeros: Tensor, shape: tuple[int, int], block: int, group: int,
    dtype: torch.dtype, scratch: bool = False,
) -> Tensor:  # fmt: skip
    """The (out, in) matrix of torch's CPU int4 packing (`block` output channels interleaved,
    a scale and zero per `group` inputs), as a transposed view of a contiguous (in, out)
    tensor: the layout the packing unpacks to in order, which a GEMM reads as well as the
    other. `scratch`: in this thread's buffer for the shape, overwritten by the next call
    (for one product, not to keep)."""
    lib = _library()
    assert lib is not None and packed.is_contiguous() and scales_zeros.is_contiguous()
    out_f, in_f = shape
    out = _empty((in_f, out_f), dtype, scratch)
    lib.int4_to_dense_t(
        packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(),
        out_f, in_f, block, group, dtype == torch.bfloat16,
    )  # fmt: skip
    return out.t()


def int8_dense(weight: Tensor, scales: Tensor, dtype: torch.dtype, scratch: bool = False) -> Tensor:
    """The (out, in) matrix of int8 weights with a bf16 scale per output channel (`scratch`:
    as for int4_dense)."""
    lib = _library()
    assert lib is not None and weight.is_contiguous() and scales.is_contiguous()
    out_f, in_f = weight.shape
    out = _empty((out_f, in_f), dtype, scratch)
    lib.int8_to_dense(
        weight.data_ptr(), scales.data_ptr(), out.data_ptr(), out_f, in_f,
        dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def _empty(shape: tuple[int, int], dtype: torch.dtype, scratch: bool) -> Tensor:
    if not scratch:
        return torch.empty(shape, dtype=dtype)
    if not hasattr(_scratch, "buffers"):
        _scratch.buffers = {}
    buffers: dict[tuple, Tensor] = _scratch.buffers
    if (shape, dtype) not in buffers:
        buffers[shape, dtype] = torch.empty(shape, dtype=dtype)
    return buffers[shape, dtype]
