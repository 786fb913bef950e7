"""The KV cache: every layer's keys and values for the tokens seen so far, so that a decode step
computes K and V for its one new token only and reuses the rest.

This is the simple contiguous form, one buffer per sequence sized for prompt + max new tokens.
"""

from __future__ import annotations

import torch

from pellucid.models.config import ModelConfig
from pellucid.models.context import ForwardContext


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype):
        shape = (1, max_len, cfg.n_kv_heads, cfg.head_dim)  # (B, S, n_kv, hd)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.length = 0  # tokens cached so far
        self.bytes_per_token = cfg.kv_bytes_per_token(self.k[0].element_size())

    def context(self, n_new: int, capture_attention: set[int] | None = None) -> ForwardContext:
        """A ForwardContext that appends `n_new` tokens after what is cached."""
        assert self.length + n_new <= self.max_len, "KV cache overflow"
        ctx = ForwardContext(self.k, self.v, self.length, capture_attention or set())
        self.length += n_new
        return ctx

    @property
    def nbytes(self) -> int:
        return self.length * self.bytes_per_token
