"""The Llama family decoder (SmolLM2, Llama, Mistral, Qwen2/3 layouts): the model pellucid serves and trains.

One `forward(ids, positions, ctx)` for both uses: with a ForwardContext it reads and extends the KV
cache (inference); with `ctx=None` it attends within the given tokens only (training, recompute).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pellucid.models.config import ModelConfig
from pellucid.models.context import ForwardContext, see
from pellucid.models.layers import MLP, Attention, RMSNorm, embedding
from pellucid.models.paged_attention import causal_bias, decode_kernel_fits
from pellucid.models.rope import rope_cos_sin, rope_for_heads


class Block(nn.Module):
    """Pre-norm residual block: attention mixes information across tokens, the MLP within each."""

    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = self.make_norm(cfg)
        self.self_attn = self.make_attention(cfg, layer)
        self.post_attention_layernorm = self.make_norm(cfg)
        self.mlp = self.make_mlp(cfg)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return self.norm_class(cfg.dim, cfg.norm_eps)

    def make_attention(self, cfg: ModelConfig, layer: int) -> Attention:
        return Attention(cfg, layer)

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        return MLP(cfg)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        ctx: ForwardContext | None,
    ) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        mlp = self.mlp(self.post_attention_layernorm(h))
        see(ctx, "resid_mid", self.self_attn.layer, h)
        see(ctx, "mlp_out", self.self_attn.layer, mlp)
        return h + mlp


class LlamaModel(nn.Module):
    """Token ids -> embeddings -> n_layers blocks -> final norm -> logits over the vocabulary."""

    block_class: type[Block] = Block
    uses_rope = True  # False: positions enter as learned embeddings (GPT-2)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block_class(cfg, i) for i in range(cfg.n_layers))
        self.norm = self.make_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return self.block_class.norm_class(cfg.dim, cfg.norm_eps)

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        """ids (B, T), positions (T,) -> (B, T, dim)."""
        return self.embed_tokens(ids)

    def use_context(self, positions: int) -> None:
        """Serve sequences of up to `positions` tokens: what RoPE's tables depend on, for a model
        with LongRoPE (ModelConfig.with_context). Set before a step is compiled: a graph bakes
        the tables' divisors in."""
        self.cfg = self.cfg.with_context(positions)

    def use_decode_kernel(self) -> None:
        """Attend decode rows with decode_attention.c where it is built and fits the heads (the
        fast path's bf16 cache; the float32 reference keeps torch's kernels). Set before a step
        is compiled: a graph bakes the choice in."""
        fits = decode_kernel_fits(self.cfg)
        for block in self.layers:
            block.self_attn.decode_kernel = fits

    def rope_tables(self, positions: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(
            positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_divisors
        )

    def hidden_states(
        self, ids: Tensor, positions: Tensor, ctx: ForwardContext | None = None
    ) -> Tensor:
        """ids: (B, T), positions: (T,) -> final normalized hidden states (B, T, dim)."""
        # the residual stream in the norms' dtype: float32 on the fast path, whose embedding
        # table is bf16 (packed_model.quantize); as it is elsewhere
        x = self.embed(ids, positions).to(self.norm.weight.dtype)
        tables: dict[int, tuple[Tensor, Tensor]] = {}  # layers sharing a RoPE base share tables
        for i, layer in enumerate(self.layers):
            key = self.rope_key(i)
            if key not in tables and self.uses_rope:
                tables[key] = rope_for_heads(*self.rope_tables(positions, i), x.dtype)
            see(ctx, "resid_pre", i, x)
            x = layer(x, positions, tables.get(key), ctx)
            see(ctx, "resid_post", i, x)  # where steering and patching act
            if ctx is not None and ctx.capture_hidden_rows is not None:  # a traced request
                ctx.layer_hidden.append(x[0, ctx.capture_hidden_rows])
        x = self.norm(x)
        see(ctx, "normalized", 0, x)
        return x

    def rope_key(self, layer: int) -> int:
        return 0

    def forward(
        self, ids: Tensor, positions: Tensor | None = None, ctx: ForwardContext | None = None
    ) -> Tensor:
        """Logits (B, T, vocab). Inference passes positions and a ForwardContext (B == 1)."""
        if positions is None:
            positions = torch.arange(ids.shape[1])
        return self.compute_logits(self.hidden_states(ids, positions, ctx))

    def attend_explicitly(self, block_size: int) -> None:
        """Training in bfloat16 at this block size: attention with a stored causal mask
        (paged_attention.attend_causal_explicit) instead of SDPA, which is slow there on CPU."""
        bias = causal_bias(block_size)  # one tensor, shared by every layer
        for block in self.layers:
            block.self_attn.causal_bias = bias

    def compute_logits(self, h: Tensor) -> Tensor:
        """Hidden states (..., dim) -> float32 logits (..., vocab): the LM head."""
        return self.lm_head(h).float()
