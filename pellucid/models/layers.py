"""The pieces of a decoder block: RMSNorm, grouped-query attention over Q/K/V, and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pellucid.models.config import ModelConfig
from pellucid.models.context import ForwardContext, see
from pellucid.models.paged_attention import (
    attend,
    attend_causal,
    attend_causal_explicit,
    attention_mask,
    paged_attention,
)
from pellucid.models.rope import apply_rope


def embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding initialized as torch does, N(0, 1), except on the meta device, where a
    checkpoint fills it later: there torch's normal_ is a Python reference that first imports
    the compiler, which would be most of a warm load's time."""
    weight = torch.empty(rows, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(rows, dim, _weight=weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as the reference implementations do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x: Tensor) -> Tensor:
        """x * rsqrt(mean(x²) + eps) in float32 (one fused kernel instead of five).

        Served (no gradients), the squares are summed in float64: torch's kernel and a compiled
        step sum them in different orders, and in float32 the two sums parted in the last bit
        often enough that a compiled decode step's tokens left an eager step's (a pre-fill, a
        traced request) after a few dozen. In float64 either order rounds to the same float32.
        (torch's float64 rms_norm itself is 15x as slow as its float32 one; this, 1.3x.)"""
        if torch.is_grad_enabled():  # training: float32 is exact enough, and cheaper
            return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        x = x.float()
        mean_square = x.square().sum(-1, keepdim=True, dtype=torch.float64) / x.shape[-1]
        return x * (mean_square + self.eps).rsqrt().float()

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * self.normalize(x).to(x.dtype)


class Attention(nn.Module):
    """Each token asks (Q), every earlier token offers a match (K) and content (V).

    n_heads query heads share n_kv_heads key/value heads (GQA), which keeps the KV cache small.
    """

    norm_class: type[RMSNorm] = RMSNorm  # of the per-head Q/K norms, where cfg.qk_norm

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.scale
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        # bfloat16 training at this (T, T) size attends explicitly with it (see attend_within)
        self.causal_bias: Tensor | None = None
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        # Q, K and V read the same input: one matrix (the checkpoint's three stacked at load,
        # loading/fused.py), so one multiply instead of three
        self.qkv_proj = nn.Linear(cfg.dim, q_size + 2 * kv_size, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(q_size, cfg.dim, bias=self.output_bias(cfg))
        if cfg.qk_norm:  # each head's queries and keys scaled to one RMS (Qwen3, Gemma 3)
            self.q_norm = self.norm_class(cfg.head_dim, cfg.norm_eps)
            self.k_norm = self.norm_class(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        # decode rows by decode_attention.c: set by LlamaModel.use_decode_kernel
        self.decode_kernel = False

    def output_bias(self, cfg: ModelConfig) -> bool:
        return False  # Qwen2's biases are on Q/K/V only

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return q, k, v

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return (self.q_norm(q), self.k_norm(k)) if self.qk_norm else (q, k)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rope: tuple[Tensor, Tensor] | None,  # None: positions entered with the embeddings (GPT-2)
        ctx: ForwardContext | None,
    ) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if ctx is not None:  # inference: B == 1 and T is every token of the step
            for site, seen in (("q", q), ("k", k), ("v", v)):
                see(ctx, site, self.layer, seen)
            out = paged_attention(
                q[0], k[0], v[0], self.layer, ctx, self.window, self.scale, self.decode_kernel
            )[None]
            see(ctx, "z", self.layer, out)  # where head ablation and head patching act
        else:  # training / full recompute: causal attention within each row of the batch
            out = self.attend_within(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions
            ).transpose(1, 2)  # (B, T, H, hd)
        out = self.o_proj(out.reshape(B, T, -1))
        see(ctx, "attn_out", self.layer, out)
        return out

    def attend_within(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        """q (B, H, T, hd), k/v (B, Hkv, T, hd), the T tokens in order -> (B, H, T, hd)."""
        if self.window is None:  # positions only grow: the mask is the plain lower triangle
            bias = self.causal_bias
            training_bf16 = torch.is_grad_enabled() and q.dtype == torch.bfloat16
            if training_bf16 and bias is not None and bias.shape[0] == q.shape[2]:
                return attend_causal_explicit(q, k, v, self.scale, bias)
            return attend_causal(q, k, v, self.scale)
        return attend(q, k, v, attention_mask(positions, positions, self.window), self.scale)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SiLU for Llama, tanh-GELU for Gemma."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # gate and up read the same input: one matrix, gate's rows first (as Q/K/V above)
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def act(self, x: Tensor) -> Tensor:
        return F.silu(x)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
