"""The sampling settings a model's authors recommend, read from its files.

A GGUF may carry llama.cpp's `general.sampling.*` keys, a Hugging Face folder its
`generation_config.json`; the server uses them for what a request leaves out (as vLLM does with
generation_config.json and llama.cpp with the GGUF keys), where OpenAI's API would say
temperature 1 and top_p 1. Settings the file does not name stay at SamplingParams' defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pellucid.errors import ModelLoadError

# GGUF key -> SamplingParams field (gguf-py's Keys.General.SAMPLING_*)
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# generation_config.json key -> SamplingParams field
HF_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def from_gguf(metadata: dict[str, Any]) -> dict[str, float]:
    return {field: metadata[key] for key, field in GGUF_KEYS.items() if key in metadata}


def from_hf_folder(folder: Path) -> dict[str, float]:
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}): fix or remove it") from e
    return {field: config[key] for key, field in HF_KEYS.items() if config.get(key) is not None}
