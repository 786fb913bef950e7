"""The dense path of packed layers: a product of many rows multiplies by the matrix unpacked to
dense form (models/quant.py decides when), in the dtype the CPU multiplies fastest, with the row
count padded to a few buckets so that oneDNN builds few kernels."""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from pellucid.cpu import native_bf16

ROW_BUCKET = 32  # many-row products pad their rows to a multiple of this (or coarser): dense_mm


# Read at first use, not at import (a compiled graph must not call it while it is traced).
@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of dense copies: bf16 where the CPU multiplies it natively, else float32."""
    return torch.bfloat16 if native_bf16() else torch.float32


def dense_mm(rows: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """rows (n, in) @ w.T for many bf16 rows, n padded up to a bucket (see `bucket`), in w's
    dtype (dense_dtype()), returned in the rows'.

    Why: oneDNN builds a kernel for every distinct row count it meets and keeps it (~0.7 MB
    each, up to 1,024 of them). A server meets a new row count with almost every prompt length,
    so its memory grew by ~0.3 MiB per request. Padded, the steps of a 512-token budget meet 8
    counts, and the extra rows cost little: a product of this size takes about as long for 9
    rows as for 32, and past 128 rows a bucket holds less than half as many again."""
    n = rows.shape[0]
    # No branch on the padding being 0: compiled with n dynamic, a branch would be a guard,
    # and a second graph for row counts that fill their bucket. (`bucket`'s own branches guard
    # on n <= 128: compiled decode steps have at most max_num_seqs rows, 64 by default.)
    padded = F.pad(rows, (0, 0, 0, bucket(n) - n)).to(w.dtype)
    y = F.linear(padded, w, None if bias is None else bias.to(w.dtype))
    return y[:n].to(rows.dtype)


@functools.cache
def unpack_dtype() -> torch.dtype:
    """The dtype of a matrix unpacked for one product: dense_dtype(), unless float32 multiplies a
    pre-fill-sized product markedly faster here, as on a Xeon whose oneDNN is kept off AMX
    (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), where oneDNN's bf16 GEMM falls behind MKL's float32
    one (benchmarks/results/comments.md). Kept copies stay dense_dtype(): float32 would double
    them. Measured once per process, on a product of a few milliseconds."""
    dense = dense_dtype()
    if dense == torch.float32:
        return torch.float32
    x, w = torch.randn(512, 576), torch.randn(1536, 576)

    def seconds(dtype: torch.dtype) -> float:
        a, b = x.to(dtype), w.to(dtype)
        F.linear(a, b)  # oneDNN builds its kernel on the first call
        times = []
        for _ in range(3):
            start = time.perf_counter()
            F.linear(a, b)
            times.append(time.perf_counter() - start)
        return min(times)

    return torch.float32 if 1.2 * seconds(torch.float32) < seconds(dense) else dense


def bucket(n: int) -> int:
    """n rounded up to a multiple of ROW_BUCKET up to 4 of them, then of 2, then of 4 of them
    (32, 64, 96, 128, 192, 256, 384, 512, ...): fewer kernels for the long pre-fill steps."""
    step = ROW_BUCKET * (1 if n <= 4 * ROW_BUCKET else 2 if n <= 8 * ROW_BUCKET else 4)
    return n + (-n) % step  # written so that export can tell the padding is never negative
