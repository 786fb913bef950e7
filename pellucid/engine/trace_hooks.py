"""Where the engine calls into traced requests' recorders; a step with none traced pays nothing.
The calls, by caller:

    ModelRunner.run:   traced = traced_items(batch)                 # [] when nobody asked
                       marked = mark_prefills(traced, ctx)          # before the forward
                       after_forward(traced, logits, token_ids)     # keep the drawn logits rows
                       hand_prefills(marked, ctx)                   # attention, lens in flight
                       keep_patterns(ctx, captured)                 # LLM.run_with_cache's
    LLMEngine.step:    end_step(batch, seconds)                     # timings, KV use
    LLMEngine._analyse: ModelRunner.analyse(seq, ...)               # once done: the rest

A traced request's steps run as anyone's do (decode steps compiled). What needs the inside of the
forward (attention probabilities, each layer's hidden state for the logit lens) is kept as its
pre-fill chunks run (eager steps anyway: its queries and a few rows, the probabilities worked out
after the step), and comes from one more pass, once it is done, for the positions it decoded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from pellucid.engine.probes import hook_name, pattern_layer
from pellucid.engine.scheduler import Batch, ScheduledSeq
from pellucid.engine.sequence import Sequence
from pellucid.engine.trace_recorder import StepFacts
from pellucid.models.context import ForwardContext
from pellucid.models.paged_attention import prefill_probs


@dataclass(slots=True)
class TracedItem:
    item: ScheduledSeq
    first_row: int  # its first token among the step's flattened tokens
    prefill_index: int | None  # its slice in ctx.prefills, or None: it is a decode row
    decode_index: int | None  # its row in ctx.decode
    sample_row: int | None  # its row among the sampled logits, if it samples


def traced_items(
    batch: Batch, wanted: Callable[[Sequence], bool] = lambda seq: seq.trace is not None
) -> list[TracedItem]:
    """Where each traced (or otherwise `wanted`) sequence sits in this step's inputs; [] (at
    once) when there is none."""
    if not any(wanted(it.seq) for it in batch.items):
        return []
    found, row, n_prefill, n_decode, n_sample = [], 0, 0, 0, 0
    for it in batch.items:  # the same walk as ModelRunner.prepare
        is_decode = it.decodes  # drafts: a decode row each
        if wanted(it.seq):
            found.append(
                TracedItem(
                    it,
                    row,
                    None if is_decode else n_prefill,
                    n_decode if is_decode else None,
                    n_sample if it.samples else None,
                )
            )
        row += it.n_tokens
        n_decode += it.n_tokens if is_decode else 0
        n_prefill += not is_decode
        n_sample += it.samples
    return found


def after_forward(traced: list[TracedItem], logits: Tensor | None, token_ids: list[int]) -> None:
    """Hand each traced sequence the logits row of the token it drew; time it, to leave it out."""
    start = time.perf_counter()
    for t in traced:
        if t.sample_row is not None and logits is not None:
            seq = t.item.seq
            seq.trace.keep_token(logits[t.sample_row], token_ids[t.sample_row], seq.sampler_state)
    elapsed = time.perf_counter() - start
    for t in traced:
        t.item.seq.trace.capture_s += elapsed


def mark_prefills(traced: list[TracedItem], ctx: ForwardContext) -> list[TracedItem]:
    """The traced pre-fill chunks whose trace wants attention or the lens, marked to keep what
    those need as the step runs: their queries at the trace's layers, and (in
    ctx.capture_hidden_rows) their rows from the lens's first on. For hand_prefills."""
    marked, rows = [], []
    for t in traced:
        rec = t.item.seq.trace
        if t.prefill_index is None or not rec.wants_pass:
            continue
        marked.append(t)
        layers = frozenset(rec.options.attention_layers)
        ctx.prefills[t.prefill_index].keep_query_layers = layers
        rows += [t.first_row + r for r in rec.lens_rows(t.item.first, t.item.n_tokens)]
    if rows:
        ctx.capture_hidden_rows = torch.tensor(rows)
    return marked


def hand_prefills(marked: list[TracedItem], ctx: ForwardContext) -> None:
    """After the forward: each marked chunk's attention probabilities (worked out now from its
    queries and the cache) and hidden rows to its recorder, the time taken charged to it."""
    start = time.perf_counter()
    hidden = torch.stack(ctx.layer_hidden, 1) if ctx.layer_hidden else None  # (rows, L, dim)
    at = 0
    for t in marked:
        rec, first, n = t.item.seq.trace, t.item.first, t.item.n_tokens
        layers = rec.options.attention_layers
        attention = {layer: prefill_probs(ctx, layer, t.prefill_index) for layer in layers}
        rows = len(rec.lens_rows(first, n))
        mine = hidden[at : at + rows] if hidden is not None and rows else None
        at += rows
        rec.keep_pass(first, n, attention, mine)
    elapsed = time.perf_counter() - start
    for t in marked:
        t.item.seq.trace.capture_s += elapsed


def end_step(batch: Batch, seconds: float) -> None:
    """After the scheduler counted the step, before the tokens are appended: each traced
    sequence's recorder notes what the step did."""
    traced = [it for it in batch.items if it.seq.trace is not None]
    if not traced:
        return
    batch_tokens = sum(it.n_tokens for it in batch.items)
    kv_tokens = sum(it.seq.num_computed + it.n_tokens for it in batch.items)  # read + written
    for it in traced:
        seq = it.seq
        seq.trace.end_step(
            StepFacts(
                start=seq.num_computed - (it.n_tokens - len(it.drafts)),  # drafts: not counted
                n_tokens=it.n_tokens,
                samples=it.samples,
                prefilling=not seq.output_ids,
                cached_tokens=seq.num_cached,
                computed=seq.num_computed,
                blocks=len(seq.block_table),
                batch_rows=len(batch.items),
                batch_tokens=batch_tokens,
                batch_kv_tokens=kv_tokens,
                seconds=seconds,
            )
        )


def attention_of(ctx: ForwardContext, t: TracedItem, layers: Iterable[int]) -> dict[int, Tensor]:
    """layer -> this sequence's probs (heads, q_len, ctx) out of the step-wide capture."""
    out = {}
    for layer in layers:
        kept = ctx.attention[layer]
        if t.prefill_index is not None:
            out[layer] = kept[t.prefill_index][0]  # (heads, q_len, ctx)
        else:  # one decode row, or one per token with drafts, padded to the longest
            assert ctx.decode is not None
            rows = range(t.decode_index, t.decode_index + t.item.n_tokens)
            n = int(ctx.decode.ctx_lens[rows[-1]])
            out[layer] = kept[len(ctx.prefills)][list(rows), :, 0, :n].transpose(0, 1)
    return out


def keep_patterns(ctx: ForwardContext, captured: list[TracedItem]) -> None:
    """Hand each capture (LLM.run_with_cache) the attention patterns it asked for."""
    for t in captured:
        for layer, probs in attention_of(ctx, t, sorted(_pattern_layers(t))).items():
            seq = t.item.seq
            seq.capture.keep(hook_name("pattern", layer), probs.float(), seq.num_computed)


def pattern_layers(captured: list[TracedItem]) -> set[int]:
    """The layers whose attention probabilities this step's captures need."""
    return {layer for t in captured for layer in _pattern_layers(t)}


def _pattern_layers(t: TracedItem) -> set[int]:
    seq = t.item.seq
    if seq.capture.last_only and seq.num_computed + t.item.n_tokens < len(seq.token_ids):
        return set()  # not the chunk holding the last position
    names = seq.capture.names
    return {layer for name in names if (layer := pattern_layer(name)) is not None}
