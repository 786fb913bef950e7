"""Model families as nn.Modules: the Llama decoder, and Gemma 3 and GPT-2 as small subclasses of it."""

from pellucid.models.config import ModelConfig
from pellucid.models.gemma3 import Gemma3Model
from pellucid.models.gpt2 import GPT2Model
from pellucid.models.llama import LlamaModel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "gemma3": Gemma3Model,
    "gpt2": GPT2Model,
}


def build_model(cfg: ModelConfig) -> LlamaModel:
    return MODEL_CLASSES[cfg.arch](cfg)


__all__ = ["GPT2Model", "Gemma3Model", "LlamaModel", "ModelConfig", "build_model"]
