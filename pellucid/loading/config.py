"""ModelConfig from a checkpoint: GGUF metadata (keys prefixed by the architecture) or a Hugging
Face config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pellucid.errors import ModelLoadError
from pellucid.loading.rope_config import (
    is_long_rope,
    long_rope,
    rope_attention_factor,
    rope_divisors,
    rope_kind,
    rope_parameters,
    rope_theta,
    yarn_divisors,
    yarn_mscale,
)
from pellucid.models.config import ModelConfig

# Facts about a GGUF's tensors that its config needs, added to its metadata at load under
# pellucid's own keys (gguf_loader.metadata_with_tensor_facts)
OUTPUT_WEIGHT_KEY = "pellucid.output_weight"  # True: an LM head of its own, not the embedding
ROPE_FREQS_KEY = "pellucid.rope_freqs"  # the rope_freqs tensor: Llama 3.1's scaling
# LongRoPE's two sets (Phi-3): the rope_factors_short and rope_factors_long tensors
ROPE_SHORT_KEY, ROPE_LONG_KEY = "pellucid.rope_factors_short", "pellucid.rope_factors_long"

# Hugging Face model types pellucid runs, by the family of modules that runs them
HF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",  # its checkpoints hold Q/K/V and gate/up fused, as pellucid's layers do
    "gemma3_text": "gemma3",
}
# GGUF architectures (general.architecture), likewise; llama.cpp's converter writes Mistral as llama
GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",
    "gemma3": "gemma3",
    "gpt2": "gpt2",
}


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
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(
            f"{source}: GGUF architecture {arch!r} is not supported; "
            f"pellucid runs {', '.join(GGUF_ARCHS)}"
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
        arch=GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        norm_eps=float(get(eps_key)),
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        rope_divisors=None if gpt2 else gguf_rope_divisors(meta, arch, head_dim, source),
        long_rope=gguf_long_rope(meta, arch, head_dim, source),
        context_length=int(get("context_length")),
        # without the key (metadata read on its own), tied as the two default models are
        tie_embeddings=not meta.get(OUTPUT_WEIGHT_KEY, False),
        # llama.cpp's GPT-2 always has biases (zeros when trained without), Qwen2 on Q/K/V
        attn_bias=gpt2 or arch == "qwen2",
        # GGUF has no key for the activation: llama.cpp's GPT-2 uses tanh-GELU; pellucid's export
        # records an exact-GELU model's choice under its own key.
        hidden_act=str(get("pellucid.hidden_act", "gelu_new")) if gpt2 else "silu",
        sliding_window=gguf_sliding_window(meta, arch),
        global_every=6 if gemma else 0,
        qk_norm=gemma or arch == "qwen3",
        query_scale=None if gemma or gpt2 else gguf_query_scale(meta, arch, head_dim, source),
    ).with_context(int(get("context_length")))


def required(meta: dict[str, Any], key: str, source: str) -> Any:
    """A GGUF key the settings present make necessary; its absence is a broken file."""
    if key not in meta:
        raise ModelLoadError(f"{source}: GGUF metadata lacks {key}")
    return meta[key]


def gguf_sliding_window(meta: dict[str, Any], arch: str) -> int | None:
    """Gemma 3's local window, or Phi-3's on every layer (0 or absent: none, as in Phi-4). llama.cpp
    leaves Phi-3's out ("Phi SWA is currently disabled"); pellucid keeps it, as transformers does
    and as the same model's Hugging Face folder computes here."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    return window if window and arch in ("gemma3", "phi3") else None


def gguf_rope_divisors(
    meta: dict[str, Any], arch: str, head_dim: int, source: str
) -> tuple[float, ...] | None:
    """Rope scaling from GGUF: a linear factor (a key), per-frequency divisors (the rope_freqs
    tensor, ROPE_FREQS_KEY), or both, which llama.cpp multiplies; or YaRN's keys. Other kinds,
    and RoPE over part of a head, are errors naming the key."""
    key = f"{arch}.rope.scaling."
    scaling = str(meta.get(key + "type", "none"))
    if scaling not in ("none", "linear", "yarn"):
        raise ModelLoadError(
            f"{source}: {key}type = {scaling!r} is not supported (pellucid implements linear "
            "and yarn); its positions would be wrong"
        )
    rotated = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rotated != head_dim:
        raise ModelLoadError(
            f"{source}: {arch}.rope.dimension_count = {rotated} is not supported (RoPE rotates "
            f"all {head_dim} features of a head here)"
        )
    if scaling == "yarn":
        return gguf_yarn_divisors(meta, arch, head_dim, source)
    freqs = meta.get(ROPE_FREQS_KEY)
    linear = float(required(meta, key + "factor", source)) if scaling == "linear" else None
    if freqs is None:
        return None if linear is None else (linear,) * (head_dim // 2)
    if len(freqs) != head_dim // 2:
        raise ModelLoadError(
            f"{source}: rope_freqs has {len(freqs)} entries; heads of {head_dim} features need "
            f"{head_dim // 2}"
        )
    return tuple(float(f) * (linear or 1.0) for f in freqs)


def gguf_long_rope(
    meta: dict[str, Any], arch: str, head_dim: int, source: str
) -> tuple[tuple[float, ...], tuple[float, ...], int] | None:
    """LongRoPE's two sets of divisors (the rope_factors_short and _long tensors llama.cpp's
    converter writes for Phi-3) and the original context; None without them. Their factor on
    cos and sin is the file's rope.scaling.attn_factor (gguf_query_scale)."""
    if ROPE_LONG_KEY not in meta and ROPE_SHORT_KEY not in meta:
        return None
    sets = []
    for key in (ROPE_SHORT_KEY, ROPE_LONG_KEY):
        factors = meta.get(key)
        if factors is None or len(factors) != head_dim // 2:
            name = key.removeprefix("pellucid.") + ".weight"
            raise ModelLoadError(
                f"{source}: LongRoPE needs {name} with {head_dim // 2} entries, one per rotated "
                f"pair of a {head_dim}-feature head"
            )
        sets.append(tuple(float(f) for f in factors))
    if meta.get(ROPE_FREQS_KEY) is not None:
        raise ModelLoadError(
            f"{source}: rope_freqs and LongRoPE's factors together are not supported"
        )
    original = int(required(meta, f"{arch}.rope.scaling.original_context_length", source))
    return sets[0], sets[1], original


# YaRN settings llama.cpp's converter may write that pellucid does not implement (DeepSeek's
# log multiplier, a changed extrapolation mix, an explicit attention factor)
YARN_UNREAD = ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor")


def gguf_yarn_divisors(
    meta: dict[str, Any], arch: str, head_dim: int, source: str
) -> tuple[float, ...]:
    key = f"{arch}.rope.scaling."
    if arch == "gemma3":  # its scale would reach the local layers too
        raise ModelLoadError(f"{source}: {key}type = 'yarn' is not supported for Gemma 3")
    for name in YARN_UNREAD:
        if key + name in meta:
            raise ModelLoadError(f"{source}: {key}{name} is not supported with yarn scaling")
    return yarn_divisors(
        head_dim,
        float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        float(required(meta, key + "factor", source)),
        float(required(meta, key + "original_context_length", source)),
        float(meta.get(key + "yarn_beta_fast", 32.0)),
        float(meta.get(key + "yarn_beta_slow", 1.0)),
    )


def gguf_query_scale(meta: dict[str, Any], arch: str, head_dim: int, source: str) -> float | None:
    """The factor llama.cpp puts on cos and sin, folded into the softmax scale: the file's
    rope.scaling.attn_factor, times YaRN's 0.1 ln(factor) + 1 where it scales that way."""
    key = f"{arch}.rope.scaling."
    attention_factor = float(meta.get(key + "attn_factor", 1.0))
    if meta.get(key + "type") == "yarn":
        attention_factor *= yarn_mscale(float(required(meta, key + "factor", source)))
    return yarn_query_scale(head_dim, attention_factor)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json (as transformers 4 or 5 writes it)."""
    model_type = cfg.get("model_type", "")
    if model_type == "gpt2":
        return gpt2_config_from_hf(cfg)
    arch = HF_ARCHS.get(model_type)
    if arch is None:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"pellucid loads {', '.join([*HF_ARCHS, 'gpt2'])}"
        )
    refuse_unimplemented(cfg, source)
    n_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads)
    gemma = arch == "gemma3"
    rope = rope_parameters(cfg, "full_attention")
    local = rope_parameters(cfg, "sliding_attention")
    context = int(cfg.get("max_position_embeddings", 2048))
    if gemma and (rope_kind(rope) == "yarn" or is_long_rope(rope)):  # its scale would reach
        # the local layers too
        raise ModelLoadError(
            f"{source}: rope scaling {rope_kind(rope)!r} is not supported for Gemma 3"
        )
    if model_type == "phi3" and rope_kind(rope) == "yarn":
        # transformers reads it as LongRoPE, llama.cpp's converter with YaRN's attention factor
        raise ModelLoadError(f"{source}: rope scaling 'yarn' is not supported for Phi-3")
    long = long_rope(rope, head_dim, source) if is_long_rope(rope) else None  # checked first
    attention_factor = rope_attention_factor(rope, context)
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
        rope_theta=rope_theta(rope),
        rope_divisors=rope_divisors(rope, head_dim, context, source),
        long_rope=long,
        context_length=context,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attn_bias=model_type == "qwen2",
        sliding_window=sliding_window(cfg, model_type),
        global_every=int(cfg.get("sliding_window_pattern", 6)) if gemma else 0,
        rope_local_theta=float(cfg.get("rope_local_base_freq", rope_theta(local))),
        query_scale=(
            float(cfg["query_pre_attn_scalar"]) ** -0.5
            if gemma
            else yarn_query_scale(head_dim, attention_factor)
        ),
        qk_norm=gemma or model_type == "qwen3",
    ).with_context(context)


def yarn_query_scale(head_dim: int, attention_factor: float) -> float | None:
    """The softmax scale with YaRN's factor on cos and sin folded in (squared: it scales both q
    and k); None, the plain head_dim ** -0.5, without one."""
    return None if attention_factor == 1.0 else head_dim**-0.5 * attention_factor**2


def sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The window of the local layers: Gemma 3's (five in six layers), Mistral's or Phi-3's
    (all of them)."""
    if model_type in ("gemma3_text", "mistral", "phi3") and cfg.get("sliding_window"):
        return int(cfg["sliding_window"])
    return None


def refuse_unimplemented(cfg: dict[str, Any], source: str) -> None:
    """A setting that changes the math and that pellucid does not implement is an error naming
    it: a model that loads must compute what its authors' code computes."""

    def refuse(key: str, why: str) -> None:
        raise ModelLoadError(f"{source}: {key} = {cfg[key]!r} is not supported ({why})")

    for key in ("hidden_act", "hidden_activation"):
        if cfg.get("model_type") != "gemma3_text" and cfg.get(key) not in (None, "silu"):
            refuse(key, "this family's MLP is SiLU-gated")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key) and cfg.get("model_type") != "qwen2":
            refuse(key, "biases on these projections are not loaded")
    if cfg.get("use_sliding_window"):
        refuse("use_sliding_window", "Qwen's per-layer windows are not implemented")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial_rotary_factor", "RoPE rotates every feature of a head here")


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
