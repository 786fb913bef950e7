"""ModelRunner: turns a scheduled batch into model inputs, runs one forward pass, samples.

All tokens of the step are flattened into one row: pre-fill chunks contribute many tokens each
(processed in parallel), decoding sequences one token each. Only the last position of each
sequence that is due a new token goes through the LM head. A decoding sequence's guesses
(drafts) go in as decode rows of their own, each attending to the tokens before it, so a step
with drafts is still a decode step (compiled); their logits come back for the engine to check.
The runner reads the sequences and changes none of them: what it sampled comes back as a
`StepResult`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pellucid.engine import aot_decode
from pellucid.engine.compiled_decode import CompiledDecode, prepare
from pellucid.engine.kv_cache import KVCachePool, lazy_zeros
from pellucid.engine.outputs import TokenLogprob
from pellucid.engine.probes import Probe
from pellucid.engine.sampler import sample
from pellucid.engine.scheduler import Batch, ScheduledSeq
from pellucid.engine.sequence import Sequence
from pellucid.engine.trace_hooks import (
    after_forward,
    hand_prefills,
    keep_patterns,
    mark_prefills,
    pattern_layers,
    traced_items,
)
from pellucid.models.context import DecodeBatch, ForwardContext, PrefillSlice
from pellucid.models.llama import LlamaModel
from pellucid.models.packed_model import make_dense
from pellucid.models.quant import DENSE_ROWS

# Positions a trace's analysis pass takes at once: bounds the attention it holds at a time
ANALYSIS_ROWS = 256


@dataclass(slots=True)
class StepResult:
    """What one step sampled, in the order of `batch.sampling`."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the request did not ask for logprobs
    seconds: float  # the step's forward pass and sampling
    # per sampled sequence, the logits (len(drafts), V) after each of its drafts, or None
    draft_logits: list[Tensor | None]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: KVCachePool,
        compile: bool = False,
        in_background: bool = False,
        ahead: bool = True,
    ):
        self.model = model
        self.pool = pool
        self.dense_kept = False  # see logits
        # made here, outside inference mode, as the real pool is: graphs guard on that
        self.scratch = _scratch(pool) if in_background and compile else None
        example = self.example_step if in_background else None
        # the decode steps compiled ahead (`pellucid compile`), loaded in milliseconds
        steps = aot_decode.load(model) if ahead else {}
        self.compiled_decode: CompiledDecode | None = (
            prepare(model, example, compile, steps) if compile or steps else None
        )

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepResult:
        """One forward pass over the batch, then a token for each of `batch.sampling`."""
        start = time.perf_counter()
        ids, positions, ctx, last_rows, draft_rows = self.prepare(batch)
        traced = traced_items(batch)  # [] unless a request asked for a trace
        captured = traced_items(batch, lambda seq: seq.capture is not None)
        ctx.capture_attention.update(pattern_layers(captured))
        marked = mark_prefills(traced, ctx)  # a trace's pre-fill chunks keep a little in flight
        # interventions and captures look inside the forward: the eager step. A trace reads
        # only what the compiled step returns (what its decode rows saw comes later: analyse)
        inside = bool(ctx.capture_attention) or ctx.probe is not None
        flat = [r for rows in draft_rows for r in rows]
        logits = self.logits(ids, positions, ctx, last_rows + flat, whole_graph=not inside)
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        drafts: list[Tensor | None] = [None] * len(last_rows)
        if logits is not None:
            logits, after_drafts = logits[: len(last_rows)], logits[len(last_rows) :]
            seqs = batch.sampling
            out = sample(logits, [s.sampler_state for s in seqs])
            token_ids = out.token_ids.tolist()
            logprobs = [
                None if s.params.logprobs is None else out.token_logprob(row, s.params.logprobs)
                for row, s in enumerate(seqs)
            ]
            drafts = _split_rows(after_drafts, draft_rows)
        if traced:
            after_forward(traced, logits, token_ids)
            hand_prefills(marked, ctx)
        keep_patterns(ctx, captured)
        return StepResult(token_ids, logprobs, time.perf_counter() - start, drafts)

    @torch.inference_mode()
    def analyse(
        self, seq: Sequence, spans: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, dict[int, Tensor], Tensor | None]]:
        """A pass over traced `seq`'s positions in `spans` ([start, end) ranges of positions it
        has computed), a chunk at a time, that keeps what its trace asks for: the attention
        probabilities at its layers and the hidden states its lens reads. What a trace shows of
        a request's decode steps once it is done, those steps having run compiled. Per chunk:
        (its first position, its length, layer -> probs (heads, q_len, ctx), hidden (rows,
        layers, dim) or None). Its attention reads the K and V the request's own steps wrote,
        and writes none."""
        rec = seq.trace
        assert rec is not None
        layers = rec.options.attention_layers
        chunks = [
            (start, min(ANALYSIS_ROWS, end - start))
            for first, end in spans
            for start in range(first, end, ANALYSIS_ROWS)
        ]
        for start, rows in chunks:
            item = ScheduledSeq(seq, rows, samples=False, start=start)
            ids, positions, ctx, _, _ = self.prepare(Batch([item]))
            ctx.capture_attention.update(layers)
            lens = rec.lens_rows(start, rows)
            if lens:
                ctx.capture_hidden_rows = torch.tensor(lens)
            ctx.write_kv = False  # its K/V are the ones its steps wrote, and stay so
            self.model.hidden_states(ids[None], positions, ctx)
            attention = {layer: ctx.attention[layer][0][0] for layer in layers}
            hidden = torch.stack(ctx.layer_hidden, 1) if ctx.layer_hidden else None
            yield start, rows, attention, hidden

    def logits(
        self,
        ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        last_rows: list[int],
        whole_graph: bool,
    ) -> Tensor | None:
        """Logits (B, vocab) of `last_rows`, in that order; None when none (pre-fill chunks)."""
        if not ctx.prefills and len(ids) > DENSE_ROWS and not self.dense_kept:
            # a batch decoding many rows repeats such steps: it keeps the packed layers' dense
            # copies rather than unpack every matrix every step (models/quant.py)
            make_dense(self.model)
            self.dense_kept = True
        if self.compiled_decode is not None and not ctx.prefills and whole_graph:
            # every row decodes one token: the whole step, LM head included, is one graph
            logits = self.compiled_decode(ids[None], positions, ctx)  # (N, vocab)
            return logits if last_rows == list(range(len(ids))) else logits[last_rows]
        hidden = self.model.hidden_states(ids[None], positions, ctx)[0]  # (N, dim)
        return self.model.compute_logits(hidden[last_rows]) if last_rows else None

    def compile_ahead(self, force: bool = False, kinds: list[int] | None = None) -> list[Path]:
        """Build the decode step's packages for this model's architecture (aot_decode.py), one
        per kind of step (`kinds`, default all), unless built before (or `force`), and use them
        from now on; their paths."""
        if self.scratch is None:
            self.scratch = _scratch(self.pool)
        paths = aot_decode.package_paths(self.model)
        for k in kinds or aot_decode.KINDS:
            if force or not paths[k].exists():
                aot_decode.build(self.model, self.example_step, k, paths[k])
        steps = aot_decode.load(self.model)
        if self.compiled_decode is None:
            self.compiled_decode = prepare(self.model, None, False, steps)
        else:
            self.compiled_decode.ahead = steps
        return [paths[k] for k in kinds or aot_decode.KINDS]

    def watch_for_packages(self, few_rows: Path) -> None:
        """Use the decode step's packages once the few-row one, being built meanwhile
        (engine/aot_build.py), exists: the steps look for it (compiled_decode.py)."""
        if self.compiled_decode is None:
            self.compiled_decode = prepare(self.model, None, False, {})
        model = self.model
        self.compiled_decode.refresh = lambda: aot_decode.load(model) if few_rows.exists() else {}

    def example_step(self, rows: int) -> tuple[Tensor, Tensor, ForwardContext]:
        """A decode step of `rows` one-token sequences for a background compile: the same
        shapes as a real step, but its K and V go to a scratch pool shaped like the real one
        (mapped, not resident: it costs the few pages written), so the requests being served
        meanwhile keep their cache."""
        assert self.scratch is not None
        k, v = self.scratch
        bs = self.pool.block_size
        slots = torch.arange(rows) * bs  # row r writes the first slot of block r
        decode = _decode_batch(list(range(rows)), [[r] for r in range(rows)], [1] * rows, bs)
        ctx = ForwardContext(k, v, slots, [], decode)
        return torch.zeros(1, rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), ctx

    def prepare(
        self, batch: Batch
    ) -> tuple[Tensor, Tensor, ForwardContext, list[int], list[list[int]]]:
        """Inputs of the step: ids, positions, context; the row of each sampled sequence's
        next token, and the rows after each of its drafts."""
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[Tensor] = []
        prefills: list[PrefillSlice] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        last_rows: list[int] = []
        draft_rows: list[list[int]] = []
        probe: Probe | None = None  # made when a request of the step needs one
        for it in batch.items:
            seq, row = it.seq, len(ids)
            start = it.first
            end = start + it.n_tokens
            if seq.params.interventions or seq.capture is not None:
                probe = probe or Probe()
                probe.add(row, start, it.n_tokens, tuple(seq.params.interventions), seq.capture)
            ids += seq.token_ids[start : end - len(it.drafts)] + it.drafts
            positions += range(start, end)
            table = torch.tensor(seq.block_table)
            pos = torch.arange(start, end)
            slots.append(table[pos // bs] * bs + pos % bs)
            if it.decodes:  # one query a row: batched with the decode rows
                decode_rows += range(row, row + it.n_tokens)
                decode_tables += [seq.block_table] * it.n_tokens
                decode_lens += range(start + 1, end + 1)  # each sees itself and those before
            else:
                prefills.append(PrefillSlice(row, it.n_tokens, end, table))
            if it.samples:
                last_rows.append(row + it.n_tokens - len(it.drafts) - 1)
                draft_rows.append(list(range(row + 1, row + it.n_tokens)) if it.drafts else [])
        ctx = ForwardContext(
            self.pool.k,
            self.pool.v,
            torch.cat(slots),
            prefills,
            _decode_batch(decode_rows, decode_tables, decode_lens, bs),
            probe=probe,
        )
        return torch.tensor(ids), torch.tensor(positions), ctx, last_rows, draft_rows


def _split_rows(logits: Tensor, rows: list[list[int]]) -> list[Tensor | None]:
    """logits (sum of len(rows), V) in the order of `rows`, back to one tensor per entry."""
    out: list[Tensor | None] = []
    at = 0
    for r in rows:
        out.append(logits[at : at + len(r)] if r else None)
        at += len(r)
    return out


def _scratch(pool: KVCachePool) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer K and V tensors shaped like the pool's, untouched by any request."""
    return [lazy_zeros(k.shape, k.dtype) for k in pool.k], [
        lazy_zeros(v.shape, v.dtype) for v in pool.v
    ]


def _decode_batch(
    rows: list[int], tables: list[list[int]], lens: list[int], block_size: int
) -> DecodeBatch | None:
    if not rows:
        return None
    # At least 2 wide: torch.compile specializes a dimension of size 1 into its own graph.
    width = max(2, max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]  # block 0 as filler, masked out
    blocks: list[int] = []
    block_rows: list[int] = []
    starts: list[int] = []
    row_blocks: list[list[int]] = []
    for row, (table, n) in enumerate(zip(tables, lens)):
        used = table[: -(-n // block_size)]  # the blocks holding its n tokens
        row_blocks.append(list(range(len(blocks), len(blocks) + len(used))))
        blocks += used
        block_rows += [row] * len(used)
        starts += range(0, len(used) * block_size, block_size)
    if len(blocks) == 1:  # one row in one block: a masked-out filler block keeps T >= 2
        blocks, block_rows, starts = blocks + [0], block_rows + [0], starts + [block_size]
    valid = [[True] * len(r) + [False] * (width - len(r)) for r in row_blocks]
    row_blocks = [r + [0] * (width - len(r)) for r in row_blocks]
    return DecodeBatch(
        torch.tensor(rows),
        torch.tensor(padded),
        torch.tensor(lens),
        torch.tensor(blocks),
        torch.tensor(block_rows),
        torch.tensor(starts),
        torch.tensor(row_blocks),
        torch.tensor(valid),
    )
