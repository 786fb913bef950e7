"""Load a GGUF checkpoint into pellucid's modules: one table maps GGUF tensor names to ours.

llama.cpp's converter changes two things that we undo here so one model definition serves GGUF
and Hugging Face checkpoints alike: it permutes Llama's Q/K rows for its interleaved RoPE (Qwen and
Phi-3 rotate halves, as pellucid does, and are stored as they are), and it stores Gemma's norm
weights as (1 + w). A tensor the table does not name stops the load: it would change the math.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from pellucid.errors import ModelLoadError
from pellucid.loading.config import (
    GGUF_ARCHS,
    OUTPUT_WEIGHT_KEY,
    ROPE_FREQS_KEY,
    ROPE_LONG_KEY,
    ROPE_SHORT_KEY,
)
from pellucid.loading.fused import fuse
from pellucid.models.config import ModelConfig
from pellucid.weights.gguf_file import GGUFFile

GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "position_embd.weight": "embed_positions.weight",  # GPT-2's learned positions
    "output_norm.weight": "norm.weight",
    "output_norm.bias": "norm.bias",
    "output.weight": "lm_head.weight",
}

BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # GPT-2 keeps Q, K and V in one matrix
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Llama has one norm before the MLP and calls it post_attention_layernorm; Gemma has four.
FFN_NORM = {
    "llama": "post_attention_layernorm",
    "gemma3": "pre_feedforward_layernorm",
    "gpt2": "post_attention_layernorm",
}
# Phi-3's checkpoints keep the MLP's gate and up as one matrix, which llama.cpp calls ffn_up
FUSED_UP = {"phi3"}
# read into the config instead (metadata_with_tensor_facts)
FACT_TENSORS = {
    "rope_freqs.weight": ROPE_FREQS_KEY,
    "rope_factors_short.weight": ROPE_SHORT_KEY,
    "rope_factors_long.weight": ROPE_LONG_KEY,
}


def our_name(gguf_name: str, arch: str) -> str | None:
    """blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight, for a file of GGUF architecture
    `arch` (None for a tensor pellucid has no place for)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    if part == "ffn_norm":
        mapped = FFN_NORM[GGUF_ARCHS[arch]]
    elif part == "ffn_up" and arch in FUSED_UP:
        mapped = "mlp.gate_up_proj"
    else:
        mapped = BLOCK_NAMES.get(part)
    return f"layers.{layer}.{mapped}.{kind}" if mapped else None


def metadata_with_tensor_facts(gguf: GGUFFile) -> dict[str, Any]:
    """The file's metadata plus what its config needs from its tensors rather than its keys:
    whether it has an LM head of its own (`output.weight`; absent, the embedding is the head)
    and rope scaling as llama.cpp's converter stores it: one divisor per rotated pair of
    features, for Llama 3.1 (`rope_freqs`), or two sets for LongRoPE (`rope_factors_short`,
    `rope_factors_long`). Kept as metadata, the weight cache stores them with it."""
    names = set(gguf.tensor_names())
    facts: dict[str, Any] = {OUTPUT_WEIGHT_KEY: "output.weight" in names}
    for name, key in FACT_TENSORS.items():
        if name in names:
            facts[key] = gguf.tensor(name).flatten().tolist()
    return gguf.metadata | facts


def unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_state_dict(gguf: GGUFFile, cfg: ModelConfig) -> dict[str, Tensor]:
    """All tensors of the file, dequantized to float32, under our module names."""
    arch = gguf.architecture
    state: dict[str, Tensor] = {}
    for name in gguf.tensor_names():
        if name in FACT_TENSORS:
            continue
        ours = our_name(name, arch)
        if ours is None:
            raise ModelLoadError(
                f"{gguf.path}: tensor {name!r} has no place in pellucid's {arch} model; "
                "computing without it would give wrong logits"
            )
        t = gguf.tensor(name)
        if arch == "llama" and ours.endswith("q_proj.weight"):
            t = unpermute_rope(t, cfg.n_heads)
        elif arch == "llama" and ours.endswith("k_proj.weight"):
            t = unpermute_rope(t, cfg.n_kv_heads)
        elif arch == "gemma3" and "norm" in ours:
            t = t - 1.0
        state[ours] = t
    return fuse(state)


def to_dtype(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    return {k: v.to(dtype) for k, v in state.items()}
