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

The kernel is compiled for this CPU at first use (models/kernels.py). Where none runs,
`available()` is False and the layers keep dense copies instead.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from pellucid.models import kernels

# Per thread, one buffer per shape and dtype for matrices unpacked for a single product, rather
# than fresh pages to fault in for each. Per thread: two engines may pre-fill in two threads.
_scratch = threading.local()


def available() -> bool:
    """Whether the kernel is built (or could be built now)."""
    return kernels.library() is not None


def int4_dense(
    packed: Tensor, scales_zeros: Tensor, shape: tuple[int, int], block: int, group: int,
    dtype: torch.dtype, scratch: bool = False,
) -> Tensor:  # fmt: skip
    """The (out, in) matrix of torch's CPU int4 packing (`block` output channels interleaved,
    a scale and zero per `group` inputs), as a transposed view of a contiguous (in, out)
    tensor: the layout the packing unpacks to in order, which a GEMM reads as well as the
    other. `scratch`: in this thread's buffer for the shape, overwritten by the next call
    (for one product, not to keep)."""
    lib = kernels.library()
    assert lib is not None and packed.is_contiguous() and scales_zeros.is_contiguous()
    out_f, in_f = shape
    out = _empty((in_f, out_f), dtype, scratch)
    lib.int4_to_dense_t(
        packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(),
        out_f, in_f, block, group, dtype == torch.bfloat16,
    )  # fmt: skip
    return out.t()


def int4_dot_dense(
    packed: Tensor, params: Tensor, shape: tuple[int, int], dtype: torch.dtype,
    scratch: bool = False, high: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The (out, in) matrix of rowdot's int4 layout (dot8, drawn in rowdot.c), or of its int5
    layout where `high` (the 5th bits' plane) is given (`scratch`: as for int4_dense)."""
    lib = kernels.library()
    assert lib is not None and packed.is_contiguous() and params.is_contiguous()
    assert high is None or high.is_contiguous()
    out = _empty(shape, dtype, scratch)
    lib.int4_dot_to_dense(
        packed.data_ptr(), None if high is None else high.data_ptr(), params.data_ptr(),
        out.data_ptr(), *shape, dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def int8_dense(weight: Tensor, scales: Tensor, dtype: torch.dtype, scratch: bool = False) -> Tensor:
    """The (out, in) matrix of int8 weights with a bf16 scale per output channel (`scratch`:
    as for int4_dense)."""
    lib = kernels.library()
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
