"""Recorder: fills one traced request's `Trace` from what the engine's hooks (trace_hooks.py)
hand it: the logits row of each drawn token (`keep_token`), the facts of each step (`end_step`),
and the attention and hidden states of its positions (`keep_pass`): a pre-fill chunk's as it
runs, the rest from one pass once the request is done (`missing` says which). `recorder.trace`
gives the records; stages, logit lens and attention lists are worked out when it is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from pellucid.engine.kv_cache import KVCachePool
from pellucid.engine.sampler import SamplerState, sampling_stages
from pellucid.engine.sampling_params import SamplingParams, TraceOptions
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
from pellucid.models.config import ModelConfig
from pellucid.models.llama import LlamaModel
from pellucid.tokenizer import Tokenizer


@dataclass(slots=True)
class StepFacts:
    """What one step did for a traced sequence, and the batch it ran in."""

    start: int  # the sequence's first position computed in this step
    n_tokens: int  # positions computed in this step
    samples: bool  # a token was sampled for it
    prefilling: bool  # its prompt is still being pre-filled
    cached_tokens: int  # of its prompt, found in the prefix cache
    computed: int  # its positions in the KV cache after the step
    blocks: int  # KV blocks it holds
    batch_rows: int  # sequences in the step
    batch_tokens: int  # positions computed in the step, all sequences together
    batch_kv_tokens: int  # K/V positions the step read and wrote
    seconds: float  # the step's forward pass and sampling


@dataclass(slots=True)
class _Raw:
    """What a forward pass left about one sampled token, turned into records when first read."""

    logits: Tensor  # (V,) the raw logits row
    state: SamplerState  # params and penalty history as they were when it was sampled


class Recorder:
    """One request's trace in the making; the engine keeps it on the Sequence as `seq.trace`.

    During a step it only keeps the drawn token's logits row: the analysis (sampling stages,
    logit lens, lists of floats) waits until `.trace` is read, so requests sharing the step
    are not kept waiting for it.
    """

    def __init__(
        self,
        options: TraceOptions,
        params: SamplingParams,
        prompt_ids: list[int],
        tokenizer: Tokenizer,
        model: LlamaModel,
        pool: KVCachePool,
        name: str = "",
    ):
        cfg = model.cfg
        options.check(cfg.n_layers, cfg.n_heads)
        self.options, self.tokenizer, self.model = options, tokenizer, model
        self.heads = options.attention_heads or list(range(cfg.n_heads))
        T = len(prompt_ids)
        # the position whose hidden states read the first token's lens (the prompt's last),
        # then each drawn token's; None: no lens asked for
        self.lens_from = T - 1 if options.logit_lens else None
        # attention or the lens need the inside of the forward pass at its positions
        self.wants_pass = bool(options.attention_layers) or options.logit_lens
        self._trace = Trace(
            model=model_info(model, name),
            sampling=_as_given(params),
            tokenization=Tokenization(
                tokenizer.decode(prompt_ids),
                [
                    TokenInfo(i, tokenizer.id_to_piece(i), tokenizer.is_special(i))
                    for i in prompt_ids
                ],
            ),
            prefill=Prefill(prompt_tokens=T, cached_tokens=0),
            kv=KVCacheInfo(
                pool.bytes_per_token,
                pool.block_size,
                cfg.n_layers,
                cfg.n_kv_heads,
                cfg.head_dim,
                pool.k[0].element_size(),
            ),
            attention=[
                AttentionMap(layer, self.heads, [[[0.0] * T for _ in range(T)] for _ in self.heads])
                for layer in sorted(set(options.attention_layers))
            ],
        )
        self._pending: tuple[int, _Raw] | None = None  # this step's token, until end_step
        self._raw: dict[int, _Raw] = {}  # step index -> its tensors, until read
        self._attention: list[tuple[int, int, Tensor]] = []  # (layer, first position, probs)
        self._lens: dict[int, Tensor] = {}  # step index -> (layers, dim) hidden, until read
        self._passed: list[tuple[int, int]] = []  # position ranges handed to keep_pass
        self.capture_s = 0.0  # recording time inside this step's forward, to leave out of it

    @property
    def trace(self) -> Trace:
        """The records so far, with every step's tensors analysed."""
        for index, raw in self._raw.items():
            self._analyse(self._trace.steps[index], raw)
        self._raw.clear()
        steps = self._trace.steps
        for index in [i for i in self._lens if i < len(steps)]:
            steps[index].lens = self._lens_of(self._lens.pop(index))
        # in position order: a decode step's row is appended after the one before it, and
        # a chunk kept in flight can come before an earlier one from the pass at the end
        for layer, first_pos, probs in sorted(self._attention, key=lambda a: a[1]):
            self._fill_attention(self._trace.attention_for(layer), first_pos, probs)
        self._attention.clear()
        return self._trace

    # --- hooks ----------------------------------------------------------------------------
    def end_step(self, step: StepFacts) -> None:
        """After a step's forward (before its token is appended): charge the time, note KV use."""
        trace = self._trace
        seconds = max(step.seconds - self.capture_s, 0.0)
        if step.prefilling:  # (a preempted sequence recomputes as decode)
            if not trace.prefill.chunks:
                trace.prefill.cached_tokens = step.cached_tokens
            trace.prefill.chunks.append(
                PrefillChunk(step.start, step.n_tokens, seconds, step.batch_tokens)
            )
        if step.samples and self._pending is not None:
            token_id, raw = self._pending
            moved = trace.model.weight_bytes + trace.kv.bytes_per_token * step.batch_kv_tokens
            token = Candidate(token_id, self.tokenizer.id_to_piece(token_id), 0.0)
            trace.steps.append(
                Step(
                    len(trace.steps),
                    token,
                    0.0,
                    [],
                    [],
                    seconds,
                    step.batch_rows,
                    step.computed,
                    step.blocks,
                    moved,
                    self.capture_s,
                )
            )
            self._raw[len(trace.steps) - 1] = raw
        self._pending, self.capture_s = None, 0.0

    def keep_drafted_token(self, logits: Tensor, token_id: int, state: SamplerState) -> None:
        """A token drawn from a draft's row (logits (V,)), in the pass of the last step that
        ran one: its own step, with no time of its own."""
        steps = self._trace.steps
        source = next(s for s in reversed(steps) if s.drafted_in is None)
        token = Candidate(token_id, self.tokenizer.id_to_piece(token_id), 0.0)
        step = Step(
            len(steps),
            token,
            0.0,
            [],
            [],
            0.0,
            source.batch_size,
            steps[-1].context_tokens + 1,
            source.kv_blocks,
            0,
            drafted_in=source.index,
        )
        steps.append(step)
        self._raw[step.index] = _Raw(logits.clone(), _snapshot(state))

    def note_draft(self, guesses: list[int], taken: int) -> None:
        """The guesses the last forward pass checked, `taken` of them the model's own."""
        source = next(s for s in reversed(self._trace.steps) if s.drafted_in is None)
        source.draft = [Candidate(i, self.tokenizer.id_to_piece(i), 0.0) for i in guesses]
        source.draft_taken = taken

    def finish(self, text: str, reason: str | None) -> None:
        self._trace.output_text, self._trace.finish_reason = text, reason

    def keep_token(self, logits: Tensor, token_id: int, state: SamplerState) -> None:
        """The sampled token with its raw logits row (V,)."""
        self._pending = (token_id, _Raw(logits.clone(), _snapshot(state)))

    def keep_pass(
        self, first_pos: int, n: int, attention: dict[int, Tensor], hidden: Tensor | None
    ) -> None:
        """The inside of the forward pass at positions [first_pos, first_pos + n): layer ->
        probs (heads, n, ctx) of their queries, and hidden (rows, layers, dim) of those from
        max(first_pos, lens_from) on. The token of step i was drawn at position lens_from + i
        (the prompt's last, then each token's)."""
        for layer, probs in attention.items():
            mine = probs if self.heads == list(range(len(probs))) else probs[self.heads]  # a copy
            self._attention.append((layer, first_pos, mine))
        if hidden is not None and self.lens_from is not None:
            first_step = max(first_pos, self.lens_from) - self.lens_from
            for row, index in enumerate(range(first_step, first_step + len(hidden))):
                self._lens[index] = hidden[row]  # step `index` may not be recorded yet
        self._passed.append((first_pos, first_pos + n))

    def lens_rows(self, first: int, n: int) -> range:
        """Of a chunk of positions [first, first + n), the offsets whose hidden states the lens
        reads (from lens_from on); empty without a lens."""
        if self.lens_from is None:
            return range(0)
        return range(min(max(self.lens_from - first, 0), n), n)

    def missing(self, n: int) -> list[tuple[int, int]]:
        """The ranges of positions [0, n) that no keep_pass has covered, in order."""
        out, at = [], 0
        for start, end in sorted(self._passed):
            if start > at:
                out.append((at, min(start, n)))
            at = max(at, end)
        return [(a, b) for a, b in out + [(at, n)] if a < b]

    # --- analysis, when the trace is read -------------------------------------------------
    def _analyse(self, step: Step, raw: _Raw) -> None:
        staged = sampling_stages(raw.logits, raw.state)
        step.stages = [self._stage(name, x) for name, x in staged]
        step.token.prob = float(torch.softmax(staged[-1][1], -1)[step.token.id])  # drawn from
        step.logprob = float(torch.log_softmax(raw.logits, -1)[step.token.id])

    def end_pass(self, seconds: float) -> None:
        self._trace.analysis_seconds = seconds

    def _lens_of(self, hidden: Tensor) -> list[LensLayer]:
        """What each layer's hidden state (layers, dim) would predict, read by the final norm
        and the LM head."""
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model.norm(hidden))  # (layers, V)
        top = torch.softmax(logits, -1).topk(self.options.lens_top_k, dim=-1)
        return [
            LensLayer(layer, self._candidates(ids, ps))
            for layer, (ids, ps) in enumerate(zip(top.indices, top.values))
        ]

    def _fill_attention(self, amap: AttentionMap, first_pos: int, probs: Tensor) -> None:
        T = self._trace.prefill.prompt_tokens
        for q in range(probs.shape[1]):
            pos = first_pos + q
            if pos < T:
                for h, row in enumerate(probs[:, q, :T].tolist()):
                    amap.prompt[h][pos][: len(row)] = row  # a chunk's keys end at its last
            elif pos - T == len(amap.steps):  # the query row of a decode step
                amap.steps.append(probs[:, q, : pos + 1].tolist())

    def _stage(self, name: str, logits: Tensor) -> Stage:
        probs = torch.softmax(logits, -1)
        top = probs.topk(self.options.top_k)
        kept = int(torch.isfinite(logits).sum())
        return Stage(name, kept, self._candidates(top.indices, top.values))

    def _candidates(self, ids: Tensor, probs: Tensor) -> list[Candidate]:
        return [
            Candidate(i, self.tokenizer.id_to_piece(i), p)
            for i, p in zip(ids.tolist(), probs.tolist())
            if p > 0
        ]


def model_info(model: LlamaModel, name: str = "") -> ModelInfo:
    cfg = model.cfg
    return ModelInfo(
        name,
        cfg.arch,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.dim,
        cfg.vocab_size,
        _weight_bytes(model),
        cfg.scale,
        flops_per_token(cfg),
    )


def flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of the matrix products of one token's pass: 2 per weight, LM head included (the
    attention over the context adds 4 x layers x heads x head_dim per token it reads)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = cfg.dim * (q + 2 * kv) + q * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    return 2 * (cfg.n_layers * per_layer + cfg.dim * cfg.vocab_size)


def _as_given(params: SamplingParams) -> dict:
    """The request's settings as plain values; each intervention as what it is and where."""
    given = {f.name: getattr(params, f.name) for f in fields(params) if f.name != "trace"}
    given["interventions"] = [iv.describe() for iv in params.interventions]
    return given


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
