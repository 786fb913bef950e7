"""A Hugging Face model folder's *.safetensors under our module names (config.json: config.py;
tokenizer.json: the tokenizer)."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from pellucid.errors import ModelLoadError
from pellucid.loading.fused import fuse

# GPT-2's names (under `transformer.`), per block and global; its linear layers are Conv1D, whose
# weight is (in, out): the transpose of nn.Linear's.
GPT2_BLOCK = {
    "ln_1": "input_layernorm",
    "attn.c_attn": "self_attn.qkv_proj",
    "attn.c_proj": "self_attn.o_proj",
    "ln_2": "post_attention_layernorm",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}
GPT2_GLOBAL = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "norm"}
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def gpt2_name(hf_name: str) -> tuple[str | None, bool]:
    """transformer.h.3.attn.c_attn.weight -> (layers.3.self_attn.qkv_proj.weight, transposed?);
    None for what pellucid does not use (the causal-mask buffers older files carry)."""
    name = hf_name.removeprefix("transformer.")
    if name == "lm_head.weight":
        return name, False
    module, kind = name.rsplit(".", 1)
    if module in GPT2_GLOBAL:
        return f"{GPT2_GLOBAL[module]}.{kind}", False
    parts = module.split(".", 2)
    if (
        len(parts) < 3
        or parts[0] != "h"
        or parts[2] not in GPT2_BLOCK
        or kind not in ("weight", "bias")
    ):
        return None, False
    return f"layers.{parts[1]}.{GPT2_BLOCK[parts[2]]}.{kind}", kind == "weight" and parts[
        2
    ] in GPT2_CONV1D


def our_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> layers.3.self_attn.q_proj.weight."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return hf_name


def hf_state_dict(folder: Path, arch: str = "llama") -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files in the model folder")
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: the safetensors file is truncated or corrupt ({e})") from e
        for k, v in tensors.items():
            if arch != "gpt2":
                state[our_name(k)] = v.float()
                continue
            name, transposed = gpt2_name(k)
            if name is not None:
                state[name] = (v.t().contiguous() if transposed else v).float()
    return fuse(state)
