"""LoRA: fine-tune a frozen nn.Linear through a low-rank update W + (alpha / r) · B·A.

Only A (r × in) and B (out × r) train; B starts at zero, so before the first step the model is
exactly the base model. `merge_lora` folds B·A into W and puts plain nn.Linear modules back, so
the exported model is the ordinary architecture that `LLM(path)` serves, with no LoRA code at all.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "up_proj", "down_proj")  # up_proj: GPT-2's


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear inits its weight

    def forward(self, x: Tensor) -> Tensor:
        # (..., in) -> (..., r) -> (..., out): never materializes the (out, in) update
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.base.weight += (self.lora_b @ self.lora_a) * self.scale
        return self.base


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = TARGETS) -> int:
    """Freeze `model`, wrap its target Linears; returns the number of trainable parameters."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    model.requires_grad_(False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, rank, alpha))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its base weight, leaving the plain architecture."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merged())
    return model
