"""FLOP accounting: the work one training token costs, and the machine's measured matmul peak.

Model FLOP utilization (MFU) = achieved FLOP/s / peak FLOP/s, where achieved counts 6 FLOPs per
parameter per token (2 forward, 4 backward) plus attention's scores and mixing (PaLM, appendix B),
and the peak is what one large matmul reaches here, in the dtype the training runs in.
"""

from __future__ import annotations

import time

import torch

from pellucid.models.config import ModelConfig


def n_params(cfg: ModelConfig) -> int:
    """Parameters of the Llama model as built (tied embeddings counted once)."""
    attn = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * cfg.dim * cfg.ffn_dim
    per_layer = attn + mlp + 2 * cfg.dim
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return cfg.vocab_size * cfg.dim + cfg.n_layers * per_layer + cfg.dim + head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at context `seq_len`."""
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6 * n_params(cfg) + attention


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
