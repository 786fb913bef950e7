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
# Qwen3.5 keeps combining marks (\p{M}) with the letters they follow
QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's letters, as code points (llama.cpp spells the ranges out in its source)
DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    # SmolLM2 (and StarCoder) isolate each number character (Unicode category N) before GPT-2's.
    "smollm": [r"\p{N}", GPT2],
    "llama3": [LLAMA3],
    "qwen2": [QWEN2],
    "qwen35": [QWEN35],
    "deepseek-llm": [
        r"[\r\n]",
        rf"\s?[{DEEPSEEK_LETTERS}]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        DEEPSEEK_CJK,
        r"\p{N}+",
    ],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
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
