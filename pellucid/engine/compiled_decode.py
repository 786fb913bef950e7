"""A compiled decode step: torch.compile (inductor) of the model's forward pass, LM head
included, for steps whose rows all decode one token — the step a chat repeats hundreds of times.

Why: in eager mode each of the ~40 small ops per layer is a separate call from Python, and over
30 layers that overhead outweighs the arithmetic of a one-token step, whose matrix kernels are
the smaller part of it. Inductor fuses the element-wise ops into a few C++ kernels. A packed
model's LM head also switches to fbgemm for one row (models/fbgemm.py): 8-bit activations, for
the head's big matrix. (Measured: benchmarks/results/comments.md.)

Shapes are dynamic (rows, block-table width), so one graph serves every context length; a
graph for one row and one for several are the only two (the int4 path adds one for more than
DENSE_ROWS rows). Compiling takes tens of seconds the first time; inductor keeps its output
under the pellucid cache folder, so a later process compiles faster.
Pre-fill steps, mixed steps and traced requests stay eager; if compiling fails (no C++ compiler,
an unsupported op), the runner logs it once and stays eager.

`prepare(model)` is the one place that sets what compiling needs of the process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

from pellucid.models.context import ForwardContext
from pellucid.models.llama import LlamaModel
from pellucid.models.quant import DENSE_ROWS, Int8Linear, make_dense
from pellucid.weights.cache import cache_root

Forward = Callable[[Tensor, Tensor, ForwardContext], Tensor]
log = logging.getLogger("pellucid")

OPTIONS = {
    # Before each call dynamo checks its guards, thousands of them over the modules' attributes.
    # A served model's modules do not change once loaded (PackedLinear's dense copy is made
    # before a graph for many rows is: see __call__), so those guards are dropped; the ones on
    # the inputs' shapes and dtypes stay.
    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    # The generated wrapper re-checks every kernel's output sizes and alignment in Python, for
    # every kernel of every layer, every token.
    "size_asserts": False,
    "alignment_asserts": False,
    "scalar_asserts": False,
    # Keep a longer element-wise result (the query after RoPE) in a buffer rather than
    # recompute it inside the attention loop for every key it meets: over a long context that
    # recomputation outweighed the rest of the step.
    "realize_cpu_opcount_threshold": 8,
}


def prepare(model: LlamaModel) -> CompiledDecode:
    """The compiled decode step of `model`, and the one setting it needs of the process:
    inductor keeps its kernels with pellucid's cache, so a later process reuses them. Inductor
    reads that folder from an environment variable when it first compiles; one a user set is
    kept."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    return CompiledDecode(model)


class CompiledDecode:
    def __init__(self, model: LlamaModel):
        self.model = model
        self.compiled: Forward | None = None  # made on the first call: importing the compiler
        self.failed = False  # takes seconds, which a load should not pay
        self.dense_made = False

    def __call__(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        if self.compiled is None and not self.failed:
            if isinstance(head := self.model.lm_head, Int8Linear):
                head.use_fbgemm()  # before tracing: the graph calls fbgemm for one row
            self.compiled = torch.compile(self.eager, dynamic=None, options=OPTIONS)
        if self.compiled is not None:
            if ids.shape[1] > DENSE_ROWS and not self.dense_made:
                make_dense(self.model)  # so many rows multiply by bf16 copies of packed weights
                self.dense_made = True
            mark_varying(ids, positions, ctx)
            try:
                return self.compiled(ids, positions, ctx)
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager still works
                log.warning("torch.compile failed (%s: %s); decoding eagerly", type(e).__name__, e)
                self.compiled, self.failed = None, True
        return self.eager(ids, positions, ctx)

    def eager(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """ids (1, N), positions (N,) -> float32 logits (N, vocab) for every row."""
        return self.model.compute_logits(self.model.hidden_states(ids, positions, ctx)[0])


def mark_varying(ids: Tensor, positions: Tensor, ctx: ForwardContext) -> None:
    """Name the sizes that change from step to step (rows, block-table width) as dynamic, so one
    graph serves them all; the rest (the KV pool, the weights) stays static, with no symbolic
    shape guards to evaluate per call."""
    for t, dim in ((ids, 1), (positions, 0), (ctx.slot_mapping, 0)):
        torch._dynamo.maybe_mark_dynamic(t, dim)
    if (d := ctx.decode) is not None:
        for t in (d.rows, d.ctx_lens, d.blocks, d.block_rows, d.block_starts):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in (d.block_tables, d.row_blocks, d.row_blocks_valid):
            torch._dynamo.maybe_mark_dynamic(t, [0, 1])
