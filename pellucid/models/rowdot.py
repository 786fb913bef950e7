"""Rows times a packed matrix by pellucid's own kernel (rowdot.c): the int4 products of CPUs
with AVX2 but without AVX-512, and of CPUs with AVX-512 VNNI.

Why: on AVX2, torch's int4 kernel widens every weight to float and multiplies in float32, 8
products per instruction; it took ~13 ms of a ~20 ms SmolLM2 token, and decoding fell behind
llama.cpp's. llama.cpp instead rounds the row to int8 (a scale per 32 inputs) and multiplies in
8-bit integers, 32 products per instruction pair, as rowdot.c does, on 4-bit weights laid out
for it (Int4DotLinear, models/quant.py), on 5-bit ones (that layout and a plane of their 5th
bits: Int5DotLinear) or on int8 ones (Int8Linear: the LM head). It beat float32 GEMMs on many
rows too, so there no dense copies are made (quant.ROWDOT_ROWS). With AVX-512 VNNI one
instruction (vpdpbusd) does what that pair does, and the kernel took half the time of torch's
AVX-512 int4 kernel for one row, and a 512-token pre-fill took less time than with bf16 GEMMs
(without AMX; benchmarks/results/comments.md). Rounding the rows costs little accuracy
(perplexity within 1% of float32: tests/test_quant.py).

The products are the custom ops `pellucid::int4_rows_mm`, `int5_rows_mm` and `int8_rows_mm`
(and the int4 LM head's, `pellucid::int4_head_mm`: lm_head.c), so that a compiled decode step
(torch.compile's or one compiled ahead, engine/aot_decode.py) calls them as it calls any other
kernel. Where rowdot is the fast path, they are C++ (ops.cpp, built at first use by
kernels.py): a call through Python cost ~20 us, more than some of the products.
Elsewhere, and where that cannot be built, the Python implementation below calls the same
kernels; it is registered as the ops' composite implementation, which a CPU one overrides.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pellucid.cpu import cpu_flags
from pellucid.models import kernels


@functools.cache
def available() -> bool:
    """Whether these kernels are the fast path for int4 here: AVX2 without AVX-512 (with AVX-512
    but not VNNI, torch's int4 kernel is kept), or AVX-512 with VNNI; and the kernels built."""
    flags = cpu_flags()
    vnni = {"avx512_vnni", "avx512vl"} <= flags
    if not ({"avx2", "fma"} <= flags and ("avx512f" not in flags or vnni) and kernels.library()):
        return False
    kernels.torch_ops()  # the ops in C++ where they build (else the Python implementation)
    return True


@functools.cache
def int8_every_row() -> bool:
    """Whether the int8 kernel takes int8 matrices at every row count: only without AVX-512,
    where the alternatives widen to float32. With AVX-512 it takes a few rows (Gemma's int8
    decoder matrices while decoding) and bf16 GEMMs the many: a 512-token pre-fill took 1.2x
    as long with it (benchmarks/results/comments.md). The LM head is the exception: see
    packed_model.quantize."""
    return available() and "avx512f" not in cpu_flags()


# Declared with torch.library's low-level API, as fbgemm.py declares its op (which defines the
# namespace: this is a fragment of it).
_LIB = torch.library.Library("pellucid", "FRAGMENT")
_LIB.define("int4_rows_mm(Tensor rows, Tensor packed, Tensor params) -> Tensor")
_LIB.define("int5_rows_mm(Tensor rows, Tensor packed, Tensor high, Tensor params) -> Tensor")
_LIB.define("int8_rows_mm(Tensor rows, Tensor weight, Tensor scales) -> Tensor")
_LIB.define(
    "int4_head_mm(Tensor rows, Tensor packed, Tensor params, Tensor table, int k) -> Tensor"
)


def int4_rows_mm(rows: Tensor, packed: Tensor, params: Tensor) -> Tensor:
    """rows (n, in) bf16 or float32 -> (n, out) in the rows' dtype: rows @ W.T for W in the
    dot8 layout (rowdot.c): packed (out/8, in/32, 4, 32) uint8, params (out/8, in/32, 2, 8)
    bf16."""
    return torch.ops.pellucid.int4_rows_mm(rows, packed, params)


def int5_rows_mm(rows: Tensor, packed: Tensor, high: Tensor, params: Tensor) -> Tensor:
    """As int4_rows_mm, for weights of 5 bits: packed holds their low 4 bits, high (out/8,
    in/32, 32) uint8 their 5th (rowdot.c's int5 layout)."""
    return torch.ops.pellucid.int5_rows_mm(rows, packed, high, params)


def int8_rows_mm(rows: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """rows (n, in) bf16 or float32 -> (n, out) float32: rows @ (weight * scales[:, None]).T for
    int8 weight (out, in) and bf16 scales (out,). float32 out: for the LM head's logits."""
    return torch.ops.pellucid.int8_rows_mm(rows, weight, scales)


def int4_head_mm(rows: Tensor, packed: Tensor, params: Tensor, table: Tensor, k: int) -> Tensor:
    """rows (n, in) bf16 or float32 -> logits (n, out) float32: rows @ W.T for W in the dot8
    layout, then each row's k largest recomputed from table (out, in) bf16 (lm_head.c)."""
    return torch.ops.pellucid.int4_head_mm(rows, packed, params, table, k)


def _head(rows: Tensor, packed: Tensor, params: Tensor, table: Tensor, k: int) -> Tensor:
    rows, out = rows.contiguous(), _int8_out(rows, table)
    kernels.library().int4_head_mm(
        rows.data_ptr(), rows.dtype == torch.bfloat16, packed.data_ptr(), params.data_ptr(),
        table.data_ptr(), k, out.data_ptr(), rows.shape[0], out.shape[1], rows.shape[1],
    )  # fmt: skip
    return out


def _call(name: str, rows: Tensor, out: Tensor, *matrix: Tensor) -> Tensor:
    """rows times the matrix held by `matrix` (its tensors in the kernel's order: packed, high,
    params; or weight, scales) into out, by rowdot.c's `name`."""
    rows = rows.contiguous()
    n, in_f = rows.shape
    getattr(kernels.library(), name)(
        rows.data_ptr(), rows.dtype == torch.bfloat16, *(t.data_ptr() for t in matrix),
        out.data_ptr(), out.dtype == torch.bfloat16, n, out.shape[1], in_f,
    )  # fmt: skip
    return out


def _int4_out(rows: Tensor, packed: Tensor) -> Tensor:
    return rows.new_empty(rows.shape[0], packed.shape[0] * 8)  # blocks of 8 channels


def _int8_out(rows: Tensor, weight: Tensor) -> Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[0], dtype=torch.float32)


_LIB.impl(
    "int4_rows_mm",
    lambda r, p, s: _call("int4_rows_mm", r, _int4_out(r, p), p, s),
    "CompositeExplicitAutograd",
)
_LIB.impl(
    "int5_rows_mm",
    lambda r, p, h, s: _call("int5_rows_mm", r, _int4_out(r, p), p, h, s),
    "CompositeExplicitAutograd",
)
_LIB.impl(
    "int8_rows_mm",
    lambda r, w, s: _call("int8_rows_mm", r, _int8_out(r, w), w, s),
    "CompositeExplicitAutograd",
)

_LIB.impl("int4_head_mm", _head, "CompositeExplicitAutograd")


@torch.library.register_fake("pellucid::int4_rows_mm")
def _(rows: Tensor, packed: Tensor, params: Tensor) -> Tensor:
    return _int4_out(rows, packed)


@torch.library.register_fake("pellucid::int5_rows_mm")
def _(rows: Tensor, packed: Tensor, high: Tensor, params: Tensor) -> Tensor:
    return _int4_out(rows, packed)


@torch.library.register_fake("pellucid::int8_rows_mm")
def _(rows: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return _int8_out(rows, weight)


@torch.library.register_fake("pellucid::int4_head_mm")
def _(rows: Tensor, packed: Tensor, params: Tensor, table: Tensor, k: int) -> Tensor:
    return _int8_out(rows, table)
