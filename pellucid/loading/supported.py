"""What pellucid runs from the models people bring, and how each was checked: `pellucid models`
prints it and the README lists it. The names here are those the loaders accept (config.py's
HF_ARCHS and GGUF_ARCHS, a test keeps them in step), so the list cannot claim what a load refuses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]  # config.json's model_type
    gguf_archs: tuple[str, ...]  # general.architecture
    what: str  # what in it pellucid implements
    checked: str  # against what, in which test


FAMILIES = (
    Family(
        "Llama 2/3.x, SmolLM2",
        ("llama",),
        ("llama",),
        "GQA; rope scaling llama3 (Llama 3.1+), linear, yarn; tied or own head; what "
        "`pellucid train` makes by default",
        "transformers 1e-4 and llama.cpp's converter + logits, greedy (test_architectures); "
        "SmolLM2 135M vs llama.cpp and transformers (test_models)",
    ),
    Family(
        "Mistral",
        ("mistral",),
        ("llama",),
        "sliding window on every layer (llama.cpp's converter drops it from a GGUF); "
        "`pellucid train --arch mistral` trains it",
        "transformers 1e-4 with the window; llama.cpp without (test_architectures); trained "
        "here and exported: transformers 1e-4 (test_train_families)",
    ),
    Family(
        "Qwen2, Qwen2.5",
        ("qwen2",),
        ("qwen2",),
        "Q/K/V biases; yarn; `pellucid train --arch qwen2` trains it",
        "transformers 1e-4, llama.cpp's converter + logits, greedy (test_architectures); "
        "trained here and exported: transformers and llama.cpp 1e-4 (test_train_families)",
    ),
    Family(
        "Qwen3 (dense)",
        ("qwen3",),
        ("qwen3",),
        "per-head Q/K RMSNorm; head_dim apart from the width; `pellucid train --arch qwen3` "
        "trains it",
        "transformers 1e-4, llama.cpp's converter + logits, greedy (test_architectures); "
        "trained here and exported: transformers and llama.cpp 1e-4 (test_train_families)",
    ),
    Family(
        "Phi-3, Phi-4",
        ("phi3",),
        ("phi3",),
        "fused QKV and gate/up; sliding window (kept from GGUF too, where llama.cpp drops it); "
        "LongRoPE (128k models: short factors where max_model_len fits the original context, "
        "long ones past it, as llama.cpp chooses by its n_ctx)",
        "transformers 1e-4, llama.cpp's converter + logits, greedy (test_architectures)",
    ),
    Family(
        "Gemma 3 (text)",
        ("gemma3_text",),
        ("gemma3",),
        "5 local : 1 global layers, two RoPE bases, Q/K norms, GELU-tanh MLP, scaled embeddings",
        "Gemma 3 270M vs llama.cpp and transformers (test_models, test_weights)",
    ),
    Family(
        "GPT-2",
        ("gpt2",),
        ("gpt2",),
        "learned positions, LayerNorm, biases; what `pellucid train` makes",
        "transformers (test_gpt2)",
    ),
)

# llama.cpp's vocabulary-only GGUFs (models/ggml-vocab-*) whose tokenizer tests pass in full
# (test_llama_cpp_vocabs); its other one (bert) is refused by name
LLAMA_CPP_VOCABS = (
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)

NOT_YET = (
    "mixture-of-experts (Qwen3-MoE, Mixtral), LongRoPE (Phi-3 128k), dynamic NTK, partial RoPE, "
    "Qwen's per-layer windows, Gemma 2 and 4: refused at load, naming what is not implemented"
)
