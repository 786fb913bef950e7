"""FLOP accounting: the work one training token costs, and the machine's measured matmul peak.

Model FLOP utilization (MFU) = achieved FLOP/s / peak FLOP/s, where achieved counts 6 FLOPs per
parameter per token (2 forward, 4 backward) plus attention's scores and mixing (PaLM, appendix B),
and the peak is what one large matmul reaches here, in the dtype the training runs in.
"""

from __future__ import annotations

import time

import torch

from pellucid.models import build_model
from pellucid.models.config import ModelConfig


def n_params(cfg: ModelConfig) -> int:
    """Parameters of the model as built (tied embeddings counted once), counted on a skeleton
    on the meta device, so no memory is allocated."""
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied tensor once


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at context `seq_len`."""
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    # a learned position table is read, not multiplied: no FLOPs (the token table is, as the head)
    positions = cfg.context_length * cfg.dim if cfg.arch == "gpt2" else 0
    return 6 * (n_params(cfg) - positions) + attention


def matmul_peak(dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of n×n matmuls in `dtype`: the best of short timed bursts, so that other programs
    briefly sharing the cores lower the estimate less (this is a ceiling, not an average)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: thread pool and kernel selection
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t))
    return best
