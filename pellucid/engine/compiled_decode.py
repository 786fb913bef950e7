"""A compiled decode step: torch.compile (inductor) of the model's forward pass, LM head
included, for steps whose rows all decode one token — the step a chat repeats hundreds of times.

Why: in eager mode each of the ~40 small ops per layer is a separate call from Python, and over
30 layers that overhead outweighs the arithmetic of a one-token step, whose matrix kernels are
the smaller part of it. Inductor fuses the element-wise ops into a few C++ kernels. A packed
model's LM head also switches to fbgemm for a few rows (models/fbgemm.py): 8-bit activations, for
the head's big matrix. (Measured: benchmarks/results/comments.md.)

Shapes are dynamic (rows, block-table width), so one graph serves every context length: one
graph for one row, one for a few, and ones for many (see `KINDS`). Compiling takes tens of
seconds the first time; inductor keeps its output under the pellucid cache folder, so a later
process compiles faster.
Pre-fill steps, mixed steps and traced requests stay eager; if compiling fails (no C++ compiler,
an unsupported op), the runner logs it once and stays eager.

In the background (`prepare(model, example)`), a worker thread compiles each graph on example
inputs of its own (a scratch KV pool shaped like the real one) while the steps run eagerly, and
each kind of step switches to its graph once it is ready: a server answers at once and speeds up
seconds later, and no request waits for the compiler. Meanwhile the steps are slower than plain
eager ones, since dynamo's tracing holds Python's lock most of the time.

Steps compiled ahead of time (aot_decode.py, built by `pellucid compile`) come first: a kind of
step with a package never reaches torch.compile, and without `compile=True` (jit=False) the
kinds without one run eagerly.

`prepare` is the one place that sets what compiling needs of the process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from collections.abc import Callable

import torch
from torch import Tensor

from pellucid.models.context import ForwardContext
from pellucid.models.dense import ROW_BUCKET
from pellucid.models.llama import LlamaModel
from pellucid.models.packed_model import make_dense, use_fbgemm_head
from pellucid.models.quant import DENSE_ROWS
from pellucid.weights.cache import cache_root

Forward = Callable[[Tensor, Tensor, ForwardContext], Tensor]
# rows -> (ids (1, rows), positions (rows,), ctx): a decode step that writes to a scratch pool
Example = Callable[[int], tuple[Tensor, Tensor, ForwardContext]]
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
    # Round each op's bfloat16 result as the eager step does, where a fused kernel would keep
    # it in float32: else the compiled step's logits part from an eager step's (a pre-fill, a
    # traced or steered request), and a greedy reply changes with the step that decoded it.
    "emulate_precision_casts": True,
}


def prepare(
    model: LlamaModel,
    example: Example | None = None,
    jit: bool = True,
    ahead: dict[int, Forward] | None = None,
) -> CompiledDecode:
    """The compiled decode step of `model`, and the one setting it needs of the process:
    inductor keeps its kernels with pellucid's cache, so a later process reuses them. Inductor
    reads that folder from an environment variable when it first compiles; one a user set is
    kept. With `example`, the graphs compile in the background (see the module's docstring),
    the graphs for one row and for a few starting now. `ahead`: steps compiled ahead of time
    (aot_decode.py), by kind, used first; `jit`: torch.compile the kinds they leave out (else
    those run eagerly)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    decode = CompiledDecode(model, example, jit, ahead)
    if example is not None and jit:
        for rows in (1, 2):
            decode.compile_ahead(rows)
    return decode


# The kinds of step, each named by its fewest rows: one row; a few (the packed kernels); many (the
# dense copies, up to where dense_mm's padding changes its step: one graph must not branch on
# the rows); and more.
KINDS = (1, 2, DENSE_ROWS + 1, 4 * ROW_BUCKET + 1)
LOOK_EVERY = 1.0  # seconds between looks for a package being built (aot_build.py)


def kind(rows: int) -> int:
    """Which graph serves this many rows."""
    return max(k for k in KINDS if k <= rows)


def most_rows(kind: int) -> int | None:
    """The most rows a kind of step takes; None: no bound."""
    later = [k for k in KINDS if k > kind]
    return later[0] - 1 if later else None


class CompiledDecode:
    def __init__(
        self,
        model: LlamaModel,
        example: Example | None = None,
        jit: bool = True,
        ahead: dict[int, Forward] | None = None,
    ):
        self.model = model
        self.jit = jit
        self.ahead = ahead or {}  # kind -> a step compiled ahead of time (aot_decode.py)
        # while a package is being built (ModelRunner.watch_for_packages): what finds it ({}
        # until it exists), and when to look again (LOOK_EVERY seconds apart, not every step)
        self.refresh: Callable[[], dict[int, Forward]] | None = None
        self.next_look = 0.0
        self.compiled: Forward | None = None  # made on the first call: importing the compiler
        self.failed = False  # takes seconds, which a load should not pay
        self.dense_made = False
        self.example = example
        self.steps = 0  # steps served by a graph
        # Background compiling: the kinds of step handed to the worker, those waiting for it,
        # those whose graph is ready; the worker thread while it lives
        self.lock = threading.Lock()
        self.started: set[int] = set()
        self.pending: list[int] = []
        self.ready: set[int] = set()
        self.worker: threading.Thread | None = None
        self.idle = threading.Event()  # set while nothing waits to be compiled
        self.idle.set()

    def __call__(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        rows = ids.shape[1]
        if self.refresh is not None and kind(rows) not in self.ahead:
            self.look_for_packages()
        if (step := self.ahead.get(kind(rows))) is not None:
            self.steps += 1
            return step(ids, positions, ctx)
        if not self.jit:
            return self.eager(ids, positions, ctx)
        if self.example is not None and kind(rows) not in self.ready:
            self.compile_ahead(rows)  # no step waits: eager until its graph is ready
            return self.eager(ids, positions, ctx)
        if self.compiled is None and not self.failed:
            self.compiled = self.make_compiled()
        if self.compiled is not None:
            try:
                logits = self.run_compiled(ids, positions, ctx)
                self.steps += 1
                return logits
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager still works
                self.fail(e)
        return self.eager(ids, positions, ctx)

    def look_for_packages(self) -> None:
        """Use the packages built since this step was made, if the few-row one now exists."""
        if time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + LOOK_EVERY
        assert self.refresh is not None
        if found := self.refresh():
            self.ahead |= found
            self.refresh = None
            log.info("decoding with the step compiled ahead from now on")

    def make_compiled(self) -> Forward:
        use_fbgemm_head(self.model)  # before tracing: the graph calls fbgemm for a few rows
        # Dynamo keeps its graphs per code object, and OPTIONS drops the guards that would tell
        # two models apart (a norm's epsilon is baked into the graph): this step gets a code
        # object of its own, so that another model's graphs never serve it.
        own = types.FunctionType(CompiledDecode.eager.__code__.replace(), globals())
        return torch.compile(types.MethodType(own, self), dynamic=None, options=OPTIONS)

    def run_compiled(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        assert self.compiled is not None
        if ids.shape[1] > DENSE_ROWS and not self.dense_made:
            make_dense(self.model)  # so many rows multiply by dense copies of packed weights
            self.dense_made = True
        mark_varying(ids, positions, ctx)
        return self.compiled(ids, positions, ctx)

    def fail(self, e: Exception) -> None:
        log.warning("torch.compile failed (%s: %s); decoding eagerly", type(e).__name__, e)
        self.compiled, self.failed = None, True

    def compile_ahead(self, rows: int) -> None:
        """Hand the graph for steps of this many rows to the background worker, once."""
        k = kind(rows)
        with self.lock:
            if self.failed or k in self.started or self.example is None:
                return
            self.started.add(k)
            self.pending.append(k)
            self.idle.clear()
            if self.worker is None:  # daemon: a process that ends mid-compile just ends
                self.worker = threading.Thread(target=self._work, name="pellucid-compile")
                self.worker.daemon = True
                self.worker.start()

    def _work(self) -> None:
        """Compile what is pending, then end. A thread that lingered would keep the OpenMP
        threads its runs started, and they contend with the serving thread's (measured:
        compiled decode ~58 tok/s while it lived, ~155 once it had ended, on 2 cores)."""
        while True:
            with self.lock:
                if not self.pending:
                    self.worker = None
                    self.idle.set()
                    return
                k = self.pending.pop(0)
            self._compile_in_background(k)

    def _compile_in_background(self, k: int) -> None:
        assert self.example is not None
        if self.failed:
            return
        try:
            with torch.inference_mode():  # as the runner's steps run: graphs guard on it
                if self.compiled is None:
                    self.compiled = self.make_compiled()
                self.run_compiled(*self.example(k))
            self.ready.add(k)
            log.info("compiled the decode step for %s", _rows(k))
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager still works
            self.fail(e)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background worker has compiled every graph handed to it (True), or
        `timeout` seconds pass (False)."""
        return self.idle.wait(timeout)

    def eager(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """ids (1, N), positions (N,) -> float32 logits (N, vocab) for every row."""
        return self.model.compute_logits(self.model.hidden_states(ids, positions, ctx)[0])


def _rows(kind: int) -> str:
    most = most_rows(kind)
    return "one row" if most == 1 else f"{kind} to {most} rows" if most else f"{kind}+ rows"


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
