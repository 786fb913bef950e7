"""GPT-2 (and nanoGPT) as a small subclass of the Llama decoder: only what differs is overridden.

Differences: positions enter once, as a learned embedding added to the token embedding, instead of
rotating queries and keys (no RoPE); LayerNorm (mean and variance, with bias) instead of RMSNorm;
a plain 4x-wide GELU MLP instead of the gated one; biases on the linear layers.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from pellucid.models.config import ModelConfig
from pellucid.models.layers import Attention, embedding
from pellucid.models.llama import Block, LlamaModel


class LayerNorm(nn.LayerNorm):
    """(x - mean) / std * weight + bias over the features; nanoGPT trains it without the bias."""

    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        # in float32 as the other families' RMSNorm (no-ops when training: x is float32 there)
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), bias, self.eps)
        return out.to(x.dtype)


def layer_norm(cfg: ModelConfig) -> LayerNorm:
    return LayerNorm(cfg.dim, cfg.norm_eps, bias=cfg.attn_bias)


class GPT2Attention(Attention):
    """qkv_proj is GPT-2's c_attn, o_proj its c_proj, with a bias when the model has biases."""

    def output_bias(self, cfg: ModelConfig) -> bool:
        return cfg.attn_bias


class GPT2MLP(nn.Module):
    """down(gelu(up(x))): GPT-2's c_fc and c_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.attn_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.attn_bias)
        self.approximate = "none" if cfg.hidden_act == "gelu" else "tanh"

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))


class GPT2Block(Block):
    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return layer_norm(cfg)

    def make_attention(self, cfg: ModelConfig, layer: int) -> Attention:
        return GPT2Attention(cfg, layer)

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        return GPT2MLP(cfg)


class GPT2Model(LlamaModel):
    block_class = GPT2Block
    uses_rope = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_positions = embedding(cfg.context_length, cfg.dim)  # GPT-2's wpe

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return layer_norm(cfg)

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.embed_tokens(ids) + self.embed_positions(positions)  # (B, T, dim) + (T, dim)
