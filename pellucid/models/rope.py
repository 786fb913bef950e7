"""Rotary position embeddings (RoPE): rotate each query/key pair of features by an angle ∝ position.

Pure functions in the Hugging Face ("rotate half") layout; GGUF llama weights are un-permuted on
load so that one layout serves both checkpoint formats.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, divisors: tuple[float, ...] | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin tables for `positions` (T,) -> two (T, head_dim) float32 tensors. `divisors`
    (head_dim/2,): a long-context model's rope scaling, dividing each pair's frequency.

    The angles are float32, as the reference implementations make them; their cos and sin are
    taken in float64, then rounded: torch's float32 cos and the compiled step's differ in the
    last bit for a third of the angles, and so the compiled decode step's tokens parted from an
    eager step's. Rounded from float64, both come out the same float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if divisors is not None:
        inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1).double()  # (T, head_dim)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, T, n_heads, head_dim); cos/sin: (T, head_dim), or (T, 1, head_dim) in x's dtype
    as `rope_for_heads` makes them once per forward pass for all layers."""
    if cos.dim() == 2:
        cos, sin = rope_for_heads(cos, sin, x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_for_heads(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(T, head_dim) tables -> (T, 1, head_dim) in `dtype`: broadcast over the heads."""
    return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)
