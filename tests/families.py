"""The small random-weight models of the families people bring, built with transformers' own
classes (their configs need no download), and their GGUF as llama.cpp's own converter writes it.
Shared by tests/test_architectures.py and tests/data/make_llama_cpp_families.py, which records
llama.cpp's logits of those GGUFs."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers
from llama_cpp_source import convert, source_dir

from pellucid import catalog
from pellucid.tokenizer import Tokenizer

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# Llama 3.1's scaling with a short "original context", so that positions a test reaches fall in
# all three of its bands (kept, stretched, blended)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Qwen2.5's long-context setting (YaRN): its 512 positions stretched from 128
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
# Phi-3's LongRoPE (its 128k models): a divisor per rotated pair (8 in a 16-feature head), one
# set within an original context of 32 and one past it; IDS (40) reach past it
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.5, 10.0, 15.0, 22.0],
}
PHI3_LONG = {"rope_scaling": LONGROPE, "original_max_position_embeddings": 32, "pad_token_id": 0}
# name: (config class, model class, settings, settings without the feature under test or None)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500_000.0, "rope_scaling": LLAMA3}, {"rope_theta": 500_000.0}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1_000_000.0}, None),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1_000_000.0, "rope_scaling": YARN}, {"rope_theta": 1_000_000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, None),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}, {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 12, "pad_token_id": 0}, {"sliding_window": None, "pad_token_id": 0}),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", PHI3_LONG, {"pad_token_id": 0}),
}  # fmt: skip
IDS = [(7 * i * i + 3 * i + 11) % 256 for i in range(40)]  # longer than Mistral's window
# The settings of the GGUF each family is checked with against llama.cpp: without a window, which
# llama.cpp's converter drops for Mistral and llama.cpp leaves out for Phi-3
GGUF_SETTINGS = {name: f[3] if "sliding_window" in f[2] else f[2] for name, f in FAMILIES.items()}
# prompts for greedy decoding through the engine, several in one batch
PROMPTS = [IDS[:5], IDS[:17], IDS[3:30]]


def hf_model(name: str, settings: dict | None = None, vocab_size: int = 256) -> torch.nn.Module:
    """transformers' model of the family, random weights (seed 0) made large enough that every
    part shows in the logits: biases and norm weights are not left at 0 and 1."""
    config_class, model_class, own, _ = FAMILIES[name]
    shape = SHAPE | {"vocab_size": vocab_size}
    config = getattr(transformers, config_class)(**shape, **(own if settings is None else settings))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in key:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# The tokenizer each family's folder gets: llama.cpp's converter must recognize it (by the ids
# it gives a test text), and transformers builds Qwen2's from its vocabulary whatever the folder says
QWEN_VOCAB = "ggml-vocab-qwen2.gguf"


def family_tokenizer(name: str) -> Tokenizer:
    if name.startswith("qwen"):
        return gguf_tokenizer(source_dir() / "models" / QWEN_VOCAB)
    return gguf_tokenizer(catalog.resolve("smollm2-135m"))


@functools.cache  # two vocabularies for nine folders: each parsed from its GGUF once
def gguf_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


def converted(name: str, settings: dict | None, folder: Path) -> tuple[torch.nn.Module, Path]:
    """(transformers' model, the F32 GGUF llama.cpp's converter makes of its folder), the folder
    `folder`/hf with the family's tokenizer. The same arguments give the same bytes."""
    return converted_many({name: (name, settings)}, folder)[name]


def converted_many(
    cases: dict[str, tuple[str, dict | None]], root: Path
) -> dict[str, tuple[torch.nn.Module, Path]]:
    """converted() of each case (key: (family name, settings)) in `root`/key, by one run of the
    converter."""
    models = {key: hf_folder(name, settings, root / key) for key, (name, settings) in cases.items()}
    paths = convert(*[(root / key / "hf", root / key / "model.gguf") for key in cases])
    return {key: (models[key], path) for key, path in zip(cases, paths, strict=True)}


def hf_folder(name: str, settings: dict | None, folder: Path) -> torch.nn.Module:
    """transformers' model of the family, saved in `folder`/hf with the family's tokenizer."""
    tok = family_tokenizer(name)
    model = hf_model(name, settings, vocab_size=tok.vocab_size)
    model.save_pretrained(folder / "hf")
    tok.save_hf_folder(folder / "hf")
    if name.startswith(
        "phi3"
    ):  # its converter reads a vocabulary without tokenizer.model as Phi-4 does
        config = folder / "hf" / "tokenizer_config.json"
        config.write_text(
            json.dumps(json.loads(config.read_text()) | {"tokenizer_class": "GPT2Tokenizer"})
        )
    return model
