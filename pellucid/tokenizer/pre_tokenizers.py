"""llama.cpp's pre-tokenizers for byte-level BPE vocabularies, rebuilt as `tokenizers` ones.

A GGUF names its pre-tokenizer in `tokenizer.ggml.pre`. llama.cpp splits text with a list of
regexes, each applied to every piece the previous one left (matches and the text between them both
become pieces), then byte-encodes each piece for BPE. Regexes copied from llama.cpp's llama-vocab.cpp.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

from pellucid.errors import ModelLoadError

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 splits every digit, Llama 3 runs of up to 3

REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    # SmolLM2 (and StarCoder) isolate each number character (Unicode category N) before GPT-2's.
    "smollm": [r"\p{N}", GPT2],
    "llama3": [LLAMA3],
    "qwen2": [QWEN2],
}

# llama.cpp's other names for the same regex lists.
ALIASES = {
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "exaone4": "gpt2",
    "starcoder": "smollm",
    "refact": "smollm",
    "command-r": "smollm",
    "codeshell": "smollm",
    "exaone": "smollm",
    "minerva-7b": "smollm",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "falcon-h1": "llama3",
    "pixtral": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "qwen2",
    "megrez": "qwen2",
    "hunyuan": "qwen2",
}

# The Llama 3 family takes a whole word from the vocabulary before trying merges, and adds BOS.
LLAMA3_FAMILY = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"}


def regexes_for(pre: str) -> list[str]:
    """llama.cpp's split regexes for the pre-tokenizer named `pre` (`tokenizer.ggml.pre`)."""
    name = ALIASES.get(pre, pre)
    if name not in REGEXES:
        known = ", ".join(sorted({*REGEXES, *ALIASES}))
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported by pellucid (supported: {known}); "
            "tokenizing with another one would silently give the model wrong ids"
        )
    return REGEXES[name]


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Split like llama.cpp's `pre`, then map bytes to GPT-2's printable characters."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes_for(pre)]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
