"""A compiled decode step: torch.compile (inductor) of the model's forward pass for steps whose
rows all decode one token — the step a chat repeats hundreds of times.

Why: in eager mode each of the ~40 small ops per layer is a separate call from Python, and over
30 layers that overhead outweighs the arithmetic of a one-token step (SmolLM2 int4: ~15 ms a
token, ~5 ms of it in the matrix kernels). Inductor fuses the element-wise ops into a few C++
kernels; the same decode runs ~1.8x faster.

Shapes are dynamic (rows, block-table width), so one graph serves every context length; a
graph for one row and one for several are the only two (the int4 path adds one for more than
DENSE_ROWS rows). Compiling takes 20-90 s the first time on 2 cores; inductor keeps its output
under the pellucid cache folder, so a later process needs ~15-30 s.
Pre-fill steps, mixed steps and traced requests stay eager; if compiling fails (no C++ compiler,
an unsupported op), the runner says so once and stays eager.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from pellucid.models.context import ForwardContext
from pellucid.models.llama import LlamaModel
from pellucid.weights.cache import cache_root

Forward = Callable[[Tensor, Tensor, ForwardContext], Tensor]


class CompiledDecode:
    def __init__(self, model: LlamaModel):
        # Inductor reads this when it first compiles: its kernels persist with pellucid's cache.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        self.eager: Forward = model.hidden_states
        self.compiled: Forward | None = None  # made on the first call: importing the compiler
        self.failed = False  # takes ~1.5 s, which a load should not pay

    def __call__(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        if self.compiled is None and not self.failed:
            self.compiled = torch.compile(self.eager, dynamic=True)
        if self.compiled is not None:
            try:
                return self.compiled(ids, positions, ctx)
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager still works
                print(f"pellucid: torch.compile failed ({type(e).__name__}: {e}); "
                      "decoding eagerly", file=sys.stderr)
                self.compiled, self.failed = None, True
        return self.eager(ids, positions, ctx)
