"""ModelConfig: a model's hyperparameters (loading/config.py reads them from a checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pellucid.errors import ModelLoadError

ARCHITECTURES = ("llama", "gemma3", "gpt2")
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")  # HF's names; the last two: tanh


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # "llama" (SmolLM2, Llama, Mistral, Qwen2/3 layouts), "gemma3" or "gpt2"
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
    # rope scaling of a long-context model: each rotated pair's frequency divided by its entry
    # (loading/rope_config.py); Gemma 3 applies it to its global layers only
    rope_divisors: tuple[float, ...] | None = None
    # LongRoPE (Phi-3): two sets of divisors, (short, long), and the original context the short
    # set serves; rope_divisors is one of them, chosen by `with_context`
    long_rope: tuple[tuple[float, ...], tuple[float, ...], int] | None = None
    tie_embeddings: bool = True
    attn_bias: bool = False  # Qwen2 has biases on q/k/v; GPT-2 on every linear layer and norm
    hidden_act: str = "silu"  # GPT-2: "gelu" (exact, nanoGPT) or "gelu_new" (tanh, OpenAI's)
    # Local layers attend to the last `sliding_window` tokens; Gemma 3's have their own RoPE base,
    # and every `global_every`-th layer attends to everything (0: none does, as in Mistral).
    sliding_window: int | None = None
    global_every: int = 0
    rope_local_theta: float = 10_000.0
    query_scale: float | None = None  # softmax scale; None means head_dim ** -0.5
    qk_norm: bool = False  # each head's Q and K RMS-normalized before RoPE (Qwen3, Gemma 3)

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

    def with_context(self, positions: int) -> ModelConfig:
        """The config for sequences of up to `positions` tokens: LongRoPE's short divisors
        where they fit the original context, its long ones past it. llama.cpp chooses so by
        its context size; transformers by each forward pass's length, which would rotate a
        sequence's first tokens one way while it is short and later ones another."""
        if self.long_rope is None:
            return self
        short, long, original = self.long_rope
        return replace(self, rope_divisors=short if positions <= original else long)

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        """Gemma 3's pattern: five local layers, then one global (layer i global if
        (i+1) % 6 == 0); with global_every 0, every layer is local (Mistral)."""
        if self.sliding_window is None:
            return False
        return self.global_every == 0 or (layer + 1) % self.global_every != 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes
