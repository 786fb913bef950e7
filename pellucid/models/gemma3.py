"""Gemma 3 as a small subclass of the Llama decoder: only what differs is overridden.

Differences: RMSNorm scales by (1 + weight); embeddings are multiplied by sqrt(dim); each head's
queries and keys are RMS-normalized (QK-norm); norms before *and* after attention and MLP; a
tanh-GELU MLP; five of every six layers attend to a sliding window with their own RoPE base.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from pellucid.models.config import ModelConfig
from pellucid.models.context import ForwardContext, see
from pellucid.models.layers import MLP, Attention, RMSNorm
from pellucid.models.llama import Block, LlamaModel
from pellucid.models.rope import rope_cos_sin


class GemmaRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight.data.zero_()  # (1 + 0) is the identity scale

    def forward(self, x: Tensor) -> Tensor:
        return (self.normalize(x) * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    norm_class = GemmaRMSNorm  # of the Q/K norms (cfg.qk_norm, always set for Gemma 3)


class GemmaMLP(MLP):
    def act(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


class GemmaBlock(Block):
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.pre_feedforward_layernorm = self.make_norm(cfg)
        self.post_feedforward_layernorm = self.make_norm(cfg)

    def make_attention(self, cfg: ModelConfig, layer: int) -> Attention:
        return GemmaAttention(cfg, layer)

    def make_mlp(self, cfg: ModelConfig) -> MLP:
        return GemmaMLP(cfg)

    def forward(
        self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], ctx: ForwardContext | None
    ) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        h = x + self.post_attention_layernorm(attn)
        mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        see(ctx, "resid_mid", self.self_attn.layer, h)
        see(ctx, "mlp_out", self.self_attn.layer, mlp)
        return h + mlp


class Gemma3Model(LlamaModel):
    block_class = GemmaBlock

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        x = self.embed_tokens(ids)
        return x * x.new_tensor(self.cfg.dim**0.5)  # the scale is rounded to the weights' dtype

    def rope_key(self, layer: int) -> int:
        return int(self.cfg.is_sliding(layer))

    def rope_tables(self, positions: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        if cfg.is_sliding(layer):  # local layers: their own base, never scaled
            return rope_cos_sin(positions, cfg.head_dim, cfg.rope_local_theta)
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_divisors)
