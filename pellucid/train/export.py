"""Export a trained model as a Hugging Face folder: config.json + model.safetensors + tokenizer.json.

`LLM(folder)` and `pellucid generate --model folder` serve it; transformers' LlamaForCausalLM
reads it too. Tensor names are HF's (`model.layers.0.self_attn.q_proj.weight`): pellucid's module
names are HF's without the `model.` prefix, and RoPE uses HF's rotate-half layout, so no
permutation is needed.

    pellucid export runs/baby --out models/baby          # or --out models/baby.gguf
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from pellucid.models import build_model
from pellucid.models.config import ModelConfig
from pellucid.models.llama import LlamaModel
from pellucid.train.checkpoint import load_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_config(cfg: ModelConfig) -> dict:
    if cfg.arch != "llama":
        raise ValueError(f"export writes llama models; this one is {cfg.arch}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": cfg.attn_bias,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def export_hf(model: LlamaModel, tokenizer_folder: Path, out: Path) -> Path:
    """Write the folder next to `out`, then swap it in, so a reader never sees half a model."""
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue  # tied: HF stores the embedding once
        state[f"model.{name}" if name != "lm_head.weight" else name] = (
            t.detach().float().contiguous().clone()
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, tmp / name)
    if not (tmp / "tokenizer.json").is_file():
        raise ValueError(f"{tokenizer_folder}: no tokenizer.json to ship with the model")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def export_checkpoint(run: Path, out: Path) -> Path:
    """A training run folder (its ckpt.pt and data folder's tokenizer) -> an HF model folder,
    or a GGUF file when `out` ends in .gguf."""
    ckpt = load_checkpoint(run)
    cfg = ModelConfig(**ckpt["model_config"])
    model = build_model(cfg)
    model.load_state_dict(ckpt["model"])
    # the run folder holds a copy of the tokenizer; older runs only name their data folder
    tokenizer = run if (run / "tokenizer.json").is_file() else Path(ckpt["config"]["data"])
    if out.suffix == ".gguf":
        from pellucid.train.gguf_export import export_gguf

        return export_gguf(model, tokenizer, out)
    return export_hf(model, tokenizer, out)
