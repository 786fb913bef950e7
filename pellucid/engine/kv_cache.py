"""The KV cache: every layer's keys and values for the tokens seen so far, so that a decode step
computes K and V for its one new token only and reuses the rest.

One pool is preallocated for all sequences and cut into fixed-size blocks; the BlockManager
decides which blocks each sequence owns.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

from pellucid.models.config import ModelConfig


class KVCachePool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k: list[Tensor] = [lazy_zeros(shape, dtype) for _ in range(cfg.n_layers)]
        self.v: list[Tensor] = [lazy_zeros(shape, dtype) for _ in range(cfg.n_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_per_token = cfg.kv_bytes_per_token(self.k[0].element_size())

    @staticmethod
    def blocks_for_budget(
        cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
    ) -> int:
        per_block = cfg.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()) * block_size
        return max(1, budget_bytes // per_block)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Zeros in anonymous mmap'd memory: the OS hands out zero pages, and one takes physical
    memory only when a block on it is first written, so a 1 GiB pool costs what is used of it
    (torch.zeros would write, and so hold, all of it at once)."""
    size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)
