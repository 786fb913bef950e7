"""Weight initialization for training from scratch (inference never needs it: it loads weights).

GPT-2's scheme, as nanoGPT uses it: every matrix and embedding (tokens, and GPT-2's positions)
N(0, 0.02), the two projections that write into the residual stream (o_proj, down_proj) scaled by
1/sqrt(2·n_layers) so the stream's variance does not grow with depth; norms start at 1, biases at 0.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pellucid.models.llama import LlamaModel

STD = 0.02
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")


@torch.no_grad()
def init_weights(model: LlamaModel, gen: torch.Generator | None = None) -> None:
    residual_std = STD / math.sqrt(2 * model.cfg.n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else STD
            module.weight.normal_(0.0, std, generator=gen)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, STD, generator=gen)
        elif isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() == 1:
            module.weight.fill_(1.0)  # norm gains
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()  # LayerNorm's shift
