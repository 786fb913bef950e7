"""ModelConfig: a model's hyperparameters, read from the checkpoint (GGUF metadata or config.json)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pellucid.errors import ModelLoadError

ARCHITECTURES = ("llama", "gemma3", "gpt2")
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")  # HF's names; the last two: tanh


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # "llama" (SmolLM2, Llama, Mistral, Qwen2 layouts), "gemma3" or "gpt2"
    vocab_size: int
    dim: int  # width of the residual stream
    n_layers: int
    n_heads: int
    n_kv_heads: int  # < n_heads means grouped-query attention (GQA)
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    context_length: int
    tie_embeddings: bool = True
    attn_bias: bool = False  # Qwen2 has biases on q/k/v; GPT-2 on every linear layer and norm
    hidden_act: str = "silu"  # GPT-2: "gelu" (exact, nanoGPT) or "gelu_new" (tanh, OpenAI's)
    # Gemma 3: local layers attend to the last `sliding_window` tokens with their own RoPE base;
    # every `global_every`-th layer attends to everything.
    sliding_window: int | None = None
    global_every: int = 0
    rope_local_theta: float = 10_000.0
    query_scale: float | None = None  # softmax scale; None means head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"unknown architecture {self.arch!r}; pellucid runs {', '.join(ARCHITECTURES)}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"unknown activation {self.hidden_act!r}; pellucid runs {', '.join(ACTIVATIONS)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        """Gemma 3 pattern: five local layers, then one global (layer i global if (i+1) % 6 == 0)."""
        return self.sliding_window is not None and (layer + 1) % self.global_every != 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes


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
