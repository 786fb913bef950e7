"""Rotary position embeddings (RoPE): rotate each query/key pair of features by an angle ∝ position.

Pure functions in the Hugging Face ("rotate half") layout; GGUF llama weights are un-permuted on
load so that one layout serves both checkpoint formats.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables for `positions` (T,) -> two (T, head_dim) float32 tensors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, T, n_heads, head_dim); cos/sin: (T, head_dim)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
