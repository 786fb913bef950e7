"""ModelConfig from a checkpoint: GGUF metadata (keys prefixed by the architecture) or a Hugging
Face config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pellucid.errors import ModelLoadError
from pellucid.models.config import ARCHITECTURES, ModelConfig


def hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: no config.json; a Hugging Face model folder needs one")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    cfg = cfg.get("text_config", cfg)  # multimodal checkpoints nest the language model's config
    try:
        return config_from_hf(cfg, str(path))
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing field {e}") from e


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (keys are prefixed by the architecture name)."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: architecture {arch!r} is not supported; "
            f"pellucid runs {', '.join(ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or dim // n_heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    gemma, gpt2 = arch == "gemma3", arch == "gpt2"
    eps_key = "attention.layer_norm_epsilon" if gpt2 else "attention.layer_norm_rms_epsilon"
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        norm_eps=float(get(eps_key)),
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        context_length=int(get("context_length")),
        attn_bias=gpt2,  # llama.cpp's GPT-2 always has biases (zeros when trained without)
        # GGUF has no key for the activation: llama.cpp's GPT-2 uses tanh-GELU; pellucid's export
        # records an exact-GELU model's choice under its own key.
        hidden_act=str(get("pellucid.hidden_act", "gelu_new")) if gpt2 else "silu",
        sliding_window=int(get("attention.sliding_window")) if gemma else None,
        global_every=6 if gemma else 0,
    )


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json."""
    model_type = cfg.get("model_type", "")
    if model_type == "gpt2":
        return gpt2_config_from_hf(cfg)
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma3_text": "gemma3"}.get(
        model_type
    )
    if arch is None:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; "
            "pellucid loads llama, mistral, qwen2, gemma3_text and gpt2"
        )
    n_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads)
    gemma = arch == "gemma3"
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10_000.0)),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attn_bias=model_type == "qwen2",
        sliding_window=int(cfg["sliding_window"]) if gemma else None,
        global_every=int(cfg.get("sliding_window_pattern", 6)) if gemma else 0,
        rope_local_theta=float(cfg.get("rope_local_base_freq", 10_000.0)),
        query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
    )


def gpt2_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """GPT-2's config.json names its fields differently (n_embd, n_layer, n_head, n_inner)."""
    dim, n_heads = int(cfg["n_embd"]), int(cfg["n_head"])
    return ModelConfig(
        arch="gpt2",
        vocab_size=int(cfg["vocab_size"]),
        dim=dim,
        n_layers=int(cfg["n_layer"]),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=dim // n_heads,
        ffn_dim=int(cfg.get("n_inner") or 4 * dim),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        rope_theta=0.0,  # learned position embeddings instead
        context_length=int(cfg.get("n_positions", 1024)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attn_bias=True,
        hidden_act=str(cfg.get("activation_function", "gelu_new")),
    )
