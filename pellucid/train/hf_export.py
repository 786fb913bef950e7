"""A model as a Hugging Face folder: config.json + model.safetensors + tokenizer.json.

`LLM(folder)` and `pellucid generate --model folder` serve it; transformers' LlamaForCausalLM
(Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM for those families) or GPT2LMHeadModel
reads it too. Llama: pellucid's module names are HF's without the `model.` prefix,
and RoPE uses HF's rotate-half layout, so no permutation is needed. GPT-2: HF's own names and
Conv1D's transposed matrices, with zero biases where the model was trained without them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from pellucid.atomic import atomic_path
from pellucid.loading.fused import unfused_state
from pellucid.loading.hf_loader import GPT2_BLOCK, GPT2_CONV1D, GPT2_GLOBAL
from pellucid.models.config import ModelConfig
from pellucid.models.llama import LlamaModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# Llama's relatives, as config.json names them: (architecture, extra keys)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": False}),  # Q/K/V biases: always on
    "qwen3": ("Qwen3ForCausalLM", {"attention_bias": False, "use_sliding_window": False}),
    "mistral": ("MistralForCausalLM", {}),
}


def hf_config(cfg: ModelConfig) -> dict:
    if cfg.arch == "gpt2":
        return gpt2_hf_config(cfg)
    family = llama_family(cfg)
    if cfg.rope_divisors or cfg.long_rope:
        raise ValueError("export writes no rope scaling into config.json: this model has some")
    architecture, extra = FAMILIES[family]
    return {
        "architectures": [architecture],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.context_length,
        "tie_word_embeddings": cfg.tie_embeddings,
        "sliding_window": cfg.sliding_window,
        **extra,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def llama_family(cfg: ModelConfig) -> str:
    """Which of Llama's relatives a model of Llama's layout is, by the one switch it has on:
    Q/K/V biases (Qwen2), Q/K norms (Qwen3), a sliding window on every layer (Mistral)."""
    if cfg.arch != "llama":
        raise ValueError(f"export writes Llama's family and GPT-2; this one is {cfg.arch}")
    on = [
        family
        for family, switch in (
            ("qwen2", cfg.attn_bias),
            ("qwen3", cfg.qk_norm),
            ("mistral", cfg.sliding_window is not None and cfg.global_every == 0),
        )
        if switch
    ]
    layered = cfg.sliding_window is not None and cfg.global_every != 0
    if len(on) > 1 or layered:
        raise ValueError(
            "export writes Llama, Qwen2, Qwen3 and Mistral as trained here (at most one of Q/K/V "
            f"biases, Q/K norms, a sliding window on every layer): this model has {on}"
        )
    return on[0] if on else "llama"


def gpt2_hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.context_length,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": cfg.hidden_act,
        "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def hf_state(model: LlamaModel) -> dict[str, Tensor]:
    """The model's tensors under HF's names (tied head omitted: HF stores the embedding once)."""
    state = unfused_state(model)
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    if model.cfg.arch != "gpt2":
        return {(k if k == "lm_head.weight" else f"model.{k}"): t for k, t in state.items()}
    return gpt2_hf_state(state)


def with_biases(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """GPT-2's layout has a bias on every linear layer and norm; a model trained without them
    gets zeros, which compute the same, since GPT-2 readers (transformers, llama.cpp) need them."""
    out = dict(state)
    for name, t in state.items():
        module, kind = name.rsplit(".", 1)
        inside = module.startswith("layers.") or module == "norm"
        if kind == "weight" and inside and f"{module}.bias" not in state:
            out[f"{module}.bias"] = t.new_zeros(t.shape[0])  # a Linear's rows, a norm's features
    return out


def gpt2_hf_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our names -> HF GPT-2's, Conv1D matrices transposed."""
    block = {ours: hf for hf, ours in GPT2_BLOCK.items()}
    glob = {ours: hf for hf, ours in GPT2_GLOBAL.items()}
    out = {}
    for name, t in with_biases(state).items():
        module, kind = name.rsplit(".", 1)
        if module == "lm_head":
            out[name] = t
        elif module in glob:
            out[f"transformer.{glob[module]}.{kind}"] = t
        else:
            _, layer, part = module.split(".", 2)
            hf = block[part]
            transposed = kind == "weight" and hf in GPT2_CONV1D
            out[f"transformer.h.{layer}.{hf}.{kind}"] = t.t() if transposed else t
    return out


def export_hf(model: LlamaModel, tokenizer_folder: Path, out: Path) -> Path:
    """Write the folder next to `out`, then swap it in, so a reader never sees half a model."""
    if not (tokenizer_folder / "tokenizer.json").is_file():
        raise ValueError(f"{tokenizer_folder}: no tokenizer.json to ship with the model")
    state = {k: t.contiguous().clone() for k, t in hf_state(model).items()}
    with atomic_path(out, folder=True) as tmp:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (tokenizer_folder / name).is_file():
                shutil.copy(tokenizer_folder / name, tmp / name)
    return out
