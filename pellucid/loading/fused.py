"""Checkpoints store Q, K and V (and an MLP's gate and up) as separate matrices; pellucid's layers
hold each group as one (models/layers.py), so a step multiplies once where it would three times.
`fuse` stacks a state dict's groups at load; `split` undoes it for export."""

from __future__ import annotations

import torch
from torch import Tensor

from pellucid.models.llama import LlamaModel

# fused name -> the checkpoint's names, in the order their rows are stacked
GROUPS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The state with each layer's groups stacked along the output rows (weights and biases)."""
    out = dict(state)
    for layer in sorted({name.split(".")[1] for name in state if name.startswith("layers.")}):
        for fused, parts in GROUPS.items():
            for kind in ("weight", "bias"):
                names = [f"layers.{layer}.{part}.{kind}" for part in parts]
                if all(name in out for name in names):
                    out[f"layers.{layer}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def unfused_state(model: LlamaModel) -> dict[str, Tensor]:
    """The model's float32 tensors as checkpoints name them, for export: Q/K/V and gate/up
    apart (GPT-2 keeps Q/K/V whole: that is its c_attn)."""
    cfg = model.cfg
    state = {k: t.detach().float() for k, t in model.state_dict().items()}
    if cfg.arch == "gpt2":
        return state
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return split(state, {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.ffn_dim] * 2})


def split(state: dict[str, Tensor], sizes: dict[str, list[int]]) -> dict[str, Tensor]:
    """The state with fused groups cut back into the checkpoint's matrices; `sizes` gives each
    fused name's row counts (e.g. {"self_attn.qkv_proj": [q, kv, kv]})."""
    out = {}
    for name, t in state.items():
        module, kind = name.rsplit(".", 1)
        prefix, _, local = module.partition(".")  # "layers", "3.self_attn.qkv_proj"
        layer, _, fused = local.partition(".")
        if prefix == "layers" and fused in GROUPS and fused in sizes:
            for part, piece in zip(GROUPS[fused], t.split(sizes[fused]), strict=True):
                out[f"layers.{layer}.{part}.{kind}"] = piece
        else:
            out[name] = t
    return out
