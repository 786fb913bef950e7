"""Turn a checkpoint path into a ready model: GGUF file or Hugging Face folder -> nn.Module + config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pellucid.errors import ModelLoadError
from pellucid.loading.config import config_from_gguf, hf_config
from pellucid.loading.gguf_loader import gguf_state_dict, metadata_with_tensor_facts
from pellucid.loading.hf_loader import hf_state_dict
from pellucid.models import build_model
from pellucid.models.config import ModelConfig
from pellucid.models.llama import LlamaModel
from pellucid.models.packed_model import quantize, share_embedding
from pellucid.models.quant import packed_format
from pellucid.weights import cache as weight_cache
from pellucid.weights.gguf_file import GGUFFile


@dataclass(slots=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    state: dict[str, Tensor]  # float32, under our module names
    gguf_metadata: dict[str, Any] | None  # the tokenizer is built from this for GGUF files


def read_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path).expanduser()
    if path.is_dir():
        cfg = hf_config(path)
        return Checkpoint(path, cfg, hf_state_dict(path, cfg.arch), None)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    cached = weight_cache.load(path)
    if cached is not None:
        metadata, state = cached
        return Checkpoint(path, config_from_gguf(metadata, str(path)), state, metadata)
    gguf = GGUFFile(path)
    metadata = metadata_with_tensor_facts(gguf)
    cfg = config_from_gguf(metadata, str(path))
    state = gguf_state_dict(gguf, cfg)
    weight_cache.store(path, metadata, state)
    return Checkpoint(path, cfg, state, metadata)


def build_from_state(
    cfg: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, source: str
) -> LlamaModel:
    """Build the module on the meta device, then adopt the checkpoint tensors without copies."""
    with torch.device("meta"):
        model = build_model(cfg)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    if cfg.tie_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(
            f"{source}: checkpoint lacks {len(missing)} tensors the {cfg.arch} model needs, "
            f"e.g. {missing[:3]}"
        )
    for name, t in state.items():
        want = model.get_parameter(name).shape if name in expected else None
        if want is not None and tuple(t.shape) != tuple(want):
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(t.shape)}, want {tuple(want)}"
            )
    model.load_state_dict(
        {k: v.to(dtype) for k, v in state.items() if k in expected}, strict=False, assign=True
    )
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_int4(path: str | Path) -> tuple[ModelConfig, dict[str, Any] | None, LlamaModel]:
    """The fast path's model (packed int4/int8 matrices, a bf16 embedding table, float32 norms;
    packed_model.quantize): (config, GGUF metadata, model).

    A GGUF file's packed weights are kept in the weight cache, so a warm load reads ~100 MB and
    never builds the float32 model.
    """
    path = Path(path).expanduser()
    metadata = None if path.is_dir() or not path.exists() else weight_cache.load_metadata(path)
    packed = weight_cache.load_packed(path, packed_format()) if metadata is not None else None
    if metadata is not None and packed is not None:
        cfg = config_from_gguf(metadata, str(path))
        with torch.device("meta"):
            model = quantize(build_model(cfg), stored=set(packed))
        try:
            model.load_state_dict(packed, assign=True)
        except RuntimeError:  # not what this version packs: a miss, replaced below
            pass
        else:
            share_embedding(model)
            return cfg, metadata, model.eval().requires_grad_(False)
    ckpt = read_checkpoint(path)
    model = quantize(build_from_state(ckpt.config, ckpt.state, torch.float32, str(path)))
    if ckpt.gguf_metadata is not None:
        weight_cache.store_packed(path, packed_format(), model.state_dict())
    return ckpt.config, ckpt.gguf_metadata, model
