"""Model families as nn.Modules: the Llama decoder and Gemma 3 as a small subclass of it."""

from pellucid.models.config import ModelConfig
from pellucid.models.gemma3 import Gemma3Model
from pellucid.models.llama import LlamaModel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {"llama": LlamaModel, "gemma3": Gemma3Model}


def build_model(cfg: ModelConfig) -> LlamaModel:
    return MODEL_CLASSES[cfg.arch](cfg)


__all__ = ["Gemma3Model", "LlamaModel", "ModelConfig", "build_model"]
