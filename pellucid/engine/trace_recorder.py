"""Recorder: fills one traced request's `Trace` from the engine's hooks.

    ModelRunner.run:   traced = traced_items(batch)        # [] when nobody asked: nothing else runs
                       before_forward(ctx, traced)          # ask attention / hidden-state capture
                       after_forward(ctx, traced, logits, token_ids)   # keep a few tensors
    LLMEngine.step:    seq.trace.end_step(item, seconds, batch, pool)  # timings, KV use
    seq.trace.trace    # the records; stages, logit lens and attention lists are worked out here
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from pellucid.engine.kv_cache import KVCachePool
from pellucid.engine.sampler import SamplerState, sampling_stages
from pellucid.engine.sampling_params import SamplingParams, TraceOptions
from pellucid.engine.scheduler import Batch, ScheduledSeq
from pellucid.engine.trace_records import (
    AttentionMap,
    Candidate,
    KVCacheInfo,
    LensLayer,
    ModelInfo,
    Prefill,
    PrefillChunk,
    Stage,
    Step,
    TokenInfo,
    Tokenization,
    Trace,
)
from pellucid.models.context import ForwardContext
from pellucid.models.llama import LlamaModel
from pellucid.tokenizer import Tokenizer


@dataclass(slots=True)
class _Raw:
    """What a forward pass left about one sampled token, turned into records when first read."""

    logits: Tensor  # (V,) the raw logits row
    state: SamplerState  # params and penalty history as they were when it was sampled
    hidden: Tensor | None  # (layers, dim) after each layer, for the logit lens


class Recorder:
    """One request's trace in the making; the engine keeps it on the Sequence as `seq.trace`.

    During a step it only keeps tensors (a logits row, hidden states, attention rows): the
    analysis (sampling stages, logit lens, lists of floats) waits until `.trace` is read, so
    requests sharing the step are not kept waiting for it.
    """

    def __init__(self, options: TraceOptions, params: SamplingParams, prompt_ids: list[int],
                 tokenizer: Tokenizer, model: LlamaModel, pool: KVCachePool, name: str = ""):
        cfg = model.cfg
        check_trace_options(options, cfg.n_layers, cfg.n_heads)
        self.options, self.tokenizer, self.model = options, tokenizer, model
        self.heads = options.attention_heads or list(range(cfg.n_heads))
        T = len(prompt_ids)
        self._trace = Trace(
            model=ModelInfo(name, cfg.arch, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                            cfg.head_dim, cfg.dim, cfg.vocab_size, _weight_bytes(model), cfg.scale),
            sampling={f.name: getattr(params, f.name) for f in fields(params) if f.name != "trace"},
            tokenization=Tokenization(tokenizer.decode(prompt_ids), [
                TokenInfo(i, tokenizer.id_to_piece(i), tokenizer.is_special(i)) for i in prompt_ids
            ]),
            prefill=Prefill(prompt_tokens=T, cached_tokens=0),
            kv=KVCacheInfo(pool.bytes_per_token, pool.block_size, cfg.n_layers, cfg.n_kv_heads,
                           cfg.head_dim, pool.k[0].element_size()),
            attention=[AttentionMap(layer, self.heads, [[[0.0] * T for _ in range(T)]
                                                         for _ in self.heads])
                       for layer in sorted(set(options.attention_layers))],
        )
        self._pending: tuple[int, _Raw] | None = None  # this step's token, until end_step
        self._raw: dict[int, _Raw] = {}  # step index -> its tensors, until read
        self._attention: list[tuple[int, int, Tensor]] = []  # (layer, first position, probs)
        self._capture_s = 0.0  # recording time inside this step's forward, to leave out of it

    @property
    def trace(self) -> Trace:
        """The records so far, with every step's tensors analysed."""
        for index, raw in self._raw.items():
            self._analyse(self._trace.steps[index], raw)
        self._raw.clear()
        for layer, first_pos, probs in self._attention:
            self._fill_attention(self._trace.attention_for(layer), first_pos, probs)
        self._attention.clear()
        return self._trace

    # --- hooks ----------------------------------------------------------------------------
    def end_step(self, it: ScheduledSeq, seconds: float, batch: Batch, pool: KVCachePool) -> None:
        """After a step's forward (before its token is appended): charge the time, note KV use."""
        seq, trace = it.seq, self._trace
        seconds = max(seconds - self._capture_s, 0.0)
        start = seq.num_computed - it.n_tokens  # the scheduler has counted this step already
        if not seq.output_ids:  # still pre-filling (a preempted sequence recomputes as decode)
            if not trace.prefill.chunks:
                trace.prefill.cached_tokens = seq.num_cached
            batch_tokens = sum(i.n_tokens for i in batch.items)
            trace.prefill.chunks.append(PrefillChunk(start, it.n_tokens, seconds, batch_tokens))
        if it.samples and self._pending is not None:
            token_id, raw = self._pending
            moved = trace.model.weight_bytes + pool.bytes_per_token * sum(
                i.seq.num_computed + i.n_tokens for i in batch.items)  # K/V read + written
            token = Candidate(token_id, self.tokenizer.id_to_piece(token_id), 0.0)
            trace.steps.append(Step(len(trace.steps), token, 0.0, [], [], seconds,
                                    len(batch.items), seq.num_computed, len(seq.block_table),
                                    moved, self._capture_s))
            self._raw[len(trace.steps) - 1] = raw
        self._pending, self._capture_s = None, 0.0

    def finish(self, text: str, reason: str | None) -> None:
        self._trace.output_text, self._trace.finish_reason = text, reason

    def keep_attention(self, layer_probs: dict[int, Tensor], first_pos: int) -> None:
        """layer -> probs (heads, q_len, ctx) of this request's queries from first_pos on."""
        for layer, probs in layer_probs.items():
            if self._trace.attention_for(layer) is not None:
                self._attention.append((layer, first_pos, probs[self.heads]))  # a copy

    def keep_token(self, logits: Tensor, token_id: int, state: SamplerState,
                   hidden: Tensor | None) -> None:
        """The sampled token with its raw logits row (V,) and maybe hidden states (layers, dim)."""
        self._pending = (token_id, _Raw(logits.clone(), _snapshot(state), hidden))

    # --- analysis, when the trace is read -------------------------------------------------
    def _analyse(self, step: Step, raw: _Raw) -> None:
        staged = sampling_stages(raw.logits, raw.state)
        step.stages = [self._stage(name, x) for name, x in staged]
        step.token.prob = float(torch.softmax(staged[-1][1], -1)[step.token.id])  # drawn from
        step.logprob = float(torch.log_softmax(raw.logits, -1)[step.token.id])
        if raw.hidden is not None:
            with torch.inference_mode():
                logits = self.model.compute_logits(self.model.norm(raw.hidden))  # (layers, V)
            top = torch.softmax(logits, -1).topk(self.options.lens_top_k, dim=-1)
            step.lens = [LensLayer(layer, self._candidates(ids, ps))
                         for layer, (ids, ps) in enumerate(zip(top.indices, top.values))]

    def _fill_attention(self, amap: AttentionMap, first_pos: int, probs: Tensor) -> None:
        T = self._trace.prefill.prompt_tokens
        for q in range(probs.shape[1]):
            pos = first_pos + q
            if pos < T:
                for h, row in enumerate(probs[:, q, :T].tolist()):
                    amap.prompt[h][pos] = row
            elif pos - T == len(amap.steps):  # the query row of a decode step
                amap.steps.append(probs[:, q, : pos + 1].tolist())

    def _stage(self, name: str, logits: Tensor) -> Stage:
        probs = torch.softmax(logits, -1)
        top = probs.topk(self.options.top_k)
        kept = int(torch.isfinite(logits).sum())
        return Stage(name, kept, self._candidates(top.indices, top.values))

    def _candidates(self, ids: Tensor, probs: Tensor) -> list[Candidate]:
        return [Candidate(i, self.tokenizer.id_to_piece(i), p)
                for i, p in zip(ids.tolist(), probs.tolist()) if p > 0]


# --- the ModelRunner's side -----------------------------------------------------------------
@dataclass(slots=True)
class TracedItem:
    item: ScheduledSeq
    first_row: int  # its first token among the step's flattened tokens
    prefill_index: int | None  # its slice in ctx.prefills, or None: it is a decode row
    decode_index: int | None  # its row in ctx.decode
    sample_row: int | None  # its row among the sampled logits, if it samples


def traced_items(batch: Batch) -> list[TracedItem]:
    """Where each traced sequence sits in this step's inputs; [] (at once) when none is traced."""
    if all(it.seq.trace is None for it in batch.items):
        return []
    found, row, n_prefill, n_decode, n_sample = [], 0, 0, 0, 0
    for it in batch.items:  # the same walk as ModelRunner.prepare
        is_decode = it.n_tokens == 1
        if it.seq.trace is not None:
            found.append(TracedItem(it, row, None if is_decode else n_prefill,
                                    n_decode if is_decode else None,
                                    n_sample if it.samples else None))
        row += it.n_tokens
        n_decode, n_prefill = n_decode + is_decode, n_prefill + (not is_decode)
        n_sample += it.samples
    return found


def before_forward(ctx: ForwardContext, traced: list[TracedItem]) -> None:
    """Ask the model to keep attention probabilities and per-layer hidden states as needed."""
    for t in traced:
        ctx.capture_attention.update(t.item.seq.trace.options.attention_layers)
    rows = [t.first_row + t.item.n_tokens - 1 for t in traced
            if t.item.samples and t.item.seq.trace.options.logit_lens]
    if rows:
        ctx.capture_hidden_rows = torch.tensor(rows)


def after_forward(ctx: ForwardContext, traced: list[TracedItem], logits: Tensor | None,
                  token_ids: list[int]) -> None:
    """Hand each traced sequence what this forward showed about it; time it, to leave it out."""
    start = time.perf_counter()
    lens_row = 0
    for t in traced:
        seq, rec = t.item.seq, t.item.seq.trace
        if rec.options.attention_layers:
            rec.keep_attention(_attention_of(ctx, t), seq.num_computed)
        if t.sample_row is not None and logits is not None:
            hidden = None
            if rec.options.logit_lens:
                hidden = torch.stack([h[lens_row] for h in ctx.layer_hidden])  # (layers, dim)
                lens_row += 1
            rec.keep_token(logits[t.sample_row], token_ids[t.sample_row], seq.sampler_state,
                           hidden)
    elapsed = time.perf_counter() - start
    for t in traced:
        t.item.seq.trace._capture_s = elapsed


def _attention_of(ctx: ForwardContext, t: TracedItem) -> dict[int, Tensor]:
    """layer -> this sequence's probs (heads, q_len, ctx) out of the step-wide capture."""
    out = {}
    for layer, kept in ctx.attention.items():
        if t.prefill_index is not None:
            out[layer] = kept[t.prefill_index][0]  # (heads, q_len, ctx)
        else:
            assert ctx.decode is not None
            n = int(ctx.decode.ctx_lens[t.decode_index])
            out[layer] = kept[len(ctx.prefills)][t.decode_index, :, :, :n]  # (heads, 1, n)
    return out


def _snapshot(state: SamplerState) -> SamplerState:
    """The state as it is now: penalty history is copied, as later tokens will change it."""
    snap = copy.copy(state)
    if state.seen is not None and state.counts is not None:
        snap.seen, snap.counts = state.seen.clone(), state.counts.clone()
    return snap


def _weight_bytes(model: LlamaModel) -> int:
    """Bytes a forward pass reads from the weights (tied tensors once)."""
    tensors = {id(p): p for p in model.parameters()} | {id(b): b for b in model.buffers()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_trace_options(options: TraceOptions, n_layers: int, n_heads: int) -> None:
    bad = [layer for layer in options.attention_layers if layer >= n_layers]
    if bad:
        raise ValueError(f"trace attention_layers {bad} do not exist: the model has layers "
                         f"0..{n_layers - 1}")
    bad = [h for h in options.attention_heads or [] if h >= n_heads]
    if bad:
        raise ValueError(f"trace attention_heads {bad} do not exist: the model has heads "
                         f"0..{n_heads - 1}")
