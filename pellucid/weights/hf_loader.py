"""Load a Hugging Face model folder: config.json + *.safetensors (+ tokenizer.json, read elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from pellucid.errors import ModelLoadError
from pellucid.models.config import ModelConfig, config_from_hf


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


def our_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> layers.3.self_attn.q_proj.weight."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return hf_name


def hf_state_dict(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files in the model folder")
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: the safetensors file is truncated or corrupt ({e})") from e
        state.update({our_name(k): v.float() for k, v in tensors.items()})
    return state
