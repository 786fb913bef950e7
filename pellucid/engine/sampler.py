"""Sampler: turn a batch of logits (B, V) into one next token per row, each row with its own params.

Order (HF, vLLM): grammar mask -> penalties -> greedy argmax | temperature -> top-k -> top-p ->
min-p -> draw. The engine keeps one `SamplerState` per sequence, calls `sample(logits, states)`
once per step and then `state.update(token_id)` for every row. Maths are pure functions on
tensors (sampling_ops.py); the only state is the per-sequence history, random generator and
grammar matcher.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pellucid.engine.outputs import TokenLogprob
from pellucid.engine.sampling_ops import (
    NEG_INF,
    apply_penalties,
    apply_temperature,
    argmax_rows,
    draw,
    exp_from_max,
    logsumexp_rows,
    min_p_mask,
    top_candidates,
    top_k_mask,
    top_p_candidates,
    top_p_mask,
)
from pellucid.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

    from pellucid.engine.grammar import GrammarCompiler


class SamplerState:
    """What one sequence's sampling remembers between steps: its params, generator and history.

    Create it when the request is added, keep it on the Sequence (it survives preemption), and
    call `update(token_id)` after every token the sequence appends. Token history is kept only
    when the params have penalties, so plain requests cost nothing per step.
    """

    __slots__ = (
        "close_now",
        "counts",
        "forced",
        "forced_shut",
        "generator",
        "grammars",
        "json_at",
        "last_mask",
        "matcher",
        "params",
        "seen",
    )

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        # Seeded once; this row then draws only from it, so its tokens do not depend on the batch.
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.seen: Tensor | None = None  # (V,) bool: in prompt or output (repetition penalty)
        self.counts: Tensor | None = None  # (V,) int32: times generated (presence, frequency)
        if params.has_penalties:
            _check_token_ids(prompt_token_ids, vocab_size)
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
            self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        # Set by the engine for a request with a grammar: the llguidance matcher of this row and
        # the compiler that computes masks; `forced[i]`: the grammar left output token i no choice.
        self.matcher: llguidance.LLMatcher | None = None
        self.grammars: GrammarCompiler | None = None
        self.forced: list[bool] = []
        # The close margin took away the model's first choice (it wanted more string, another
        # call): what it closes is cut short, so the reply ends with finish_reason "length".
        self.forced_shut = False
        self.last_mask: Tensor | None = None  # (V,) bool, the grammar's mask at the last step
        # Set by the sequence once the reply has lost its way: its text loops (loops.py), or a
        # call's closing tag came inside one of its strings (block_filter.py). Close what is
        # open now, as at the close margin.
        self.close_now = False
        # Set by the sequence: where a tool call's JSON stands (BlockFilter.json_at), or None
        self.json_at: str | None = None

    def restart(self, prompt_token_ids: Sequence[int]) -> None:
        """Back to the state before the first output token (Sequence.redraw); the generator
        is kept, so the next draw differs."""
        if self.counts is not None:
            self.forget_counts()
            self.seen.zero_()
            self.seen[torch.tensor(list(prompt_token_ids), device=self.seen.device)] = True
        if self.matcher is not None:
            self.matcher.reset()
        self.forced, self.forced_shut, self.last_mask = [], False, None
        self.close_now, self.json_at = False, None

    def forget_counts(self) -> None:
        """Presence and frequency penalties start over (SamplingParams.penalties_per_block)."""
        if self.counts is not None:
            self.counts.zero_()

    def update(self, token_id: int) -> None:
        """Record a token the sequence has just generated."""
        if self.counts is not None:
            self.counts[token_id] += 1
            self.seen[token_id] = True
        if self.matcher is not None:
            self.matcher.consume_token(token_id)  # it was allowed by the mask, so this succeeds


@dataclass(slots=True)
class SamplerOutput:
    token_ids: Tensor  # (B,) int64
    # The fields below are None unless some row asked for logprobs. They come from the raw model
    # distribution, log_softmax(logits) before penalties and temperature, as OpenAI and vLLM report.
    logprobs: Tensor | None = None  # (B,) logprob of the chosen token
    top_token_ids: Tensor | None = None  # (B, n) n = largest `logprobs` in the batch; row i
    top_logprobs: Tensor | None = None  # (B, n)     should keep only its first params.logprobs

    def token_logprob(self, row: int, n_top: int) -> TokenLogprob:
        """Row's chosen token with its logprob and its `n_top` likeliest alternatives."""
        assert self.logprobs is not None and self.top_token_ids is not None
        assert self.top_logprobs is not None
        top = zip(self.top_token_ids[row, :n_top].tolist(), self.top_logprobs[row, :n_top].tolist())
        return TokenLogprob(int(self.token_ids[row]), float(self.logprobs[row]), list(top))


def sample(logits: Tensor, states: Sequence[SamplerState]) -> SamplerOutput:
    """Choose one token per row of logits (B, V); states[i] holds row i's params and history."""
    assert logits.dim() == 2 and logits.shape[0] == len(states), "one SamplerState per row"
    raw = logits.float()
    params = [s.params for s in states]
    logits = constrain(raw, states)
    logits = _penalize(logits, states) if any(p.has_penalties for p in params) else logits
    greedy = [p.is_greedy for p in params]
    if all(greedy):  # fast path: no softmax, no draw
        token_ids = argmax_rows(logits)
    else:
        values, ids = _filter(logits, params)  # (B, N): each row's candidates, or all V
        if ids is not None:  # in vocabulary order, as the whole row would be
            ids, order = ids.sort(dim=-1)
            values = values.gather(1, order)
        # Unnormalized: each weight is the same whatever else is among the candidates, so a
        # row draws the same token from its few candidates as from the whole vocabulary (the
        # batch decides which), and a seeded row's tokens do not depend on its batch-mates.
        weights = exp_from_max(values)
        token_ids = draw(weights, [s.generator for s in states], skip=greedy)
        if ids is not None:
            token_ids = ids.gather(1, token_ids[:, None]).squeeze(1)
        if any(greedy):
            is_greedy = torch.tensor(greedy, device=logits.device)
            token_ids = torch.where(is_greedy, argmax_rows(logits), token_ids)
    return _with_logprobs(raw, token_ids, params)


def sampling_stages(logits: Tensor, state: SamplerState) -> list[tuple[str, Tensor]]:
    """One row's logits (V,) after each stage of `sample`, in its order, for a traced request.

    Re-runs the same mask functions on that row alone, so `sample` (the hot path) is untouched.
    Every stage is listed even when its setting is off, so traces of all requests line up.
    """
    p = state.params
    x = logits.float()[None]  # (1, V)
    stages = [("raw", x)]
    if state.matcher is not None:  # listed only for constrained requests, which are rarer
        x = x.masked_fill(~state.last_mask[None], NEG_INF)
        stages.append(("grammar", x))
    if p.has_penalties:
        x = _penalize(x, [state])
    stages.append(("penalties", x))
    if p.is_greedy:  # argmax of the penalized logits; temperature and filters never run
        stages.append(("greedy", x.masked_fill(x < x.max(), NEG_INF)))
        return [(name, t[0]) for name, t in stages]
    x = apply_temperature(x, _row_values([p.temperature], x))
    stages.append(("temperature", x))
    if p.top_k > 0:
        x = top_k_mask(x, torch.tensor([p.top_k], device=x.device), p.top_k)
    stages.append(("top-k", x))
    if p.top_p < 1.0:
        x = top_p_mask(x, _row_values([p.top_p], x))
    stages.append(("top-p", x))
    if p.min_p > 0.0:
        x = min_p_mask(x, _row_values([p.min_p], x))
    stages.append(("min-p", x))
    return [(name, t[0]) for name, t in stages]


def constrain(logits: Tensor, states: Sequence[SamplerState]) -> Tensor:
    """Set to -inf the tokens each row's grammar forbids; rows without a grammar are untouched.

    logits (B, V). A matcher in an error state allows nothing; it is then given only its stop
    tokens (EOS), so the row ends instead of sampling from an empty distribution. In the last
    `grammar_close_margin` tokens of a row's budget, and once the reply has lost its way
    (`SamplerState.close_now`), only closing tokens stay, where the grammar allows any: a model
    looping inside a JSON string or array is made to finish it. In a tool call, a string never
    opens with a closer (`_no_string_opens_with_a_closer`).
    """
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return logits
    grammars = states[rows[0]].grammars
    allowed = grammars.token_masks([states[i].matcher for i in rows], logits.shape[-1])  # (R, V)
    eos = sorted(grammars.tokenizer.eos_ids)
    mask = torch.ones_like(logits, dtype=torch.bool)
    for row, i in enumerate(rows):
        if not allowed[row].any():
            allowed[row, eos] = True
        if states[i].json_at in ("string start", "value", "outside"):
            _no_string_opens_with_a_closer(logits[i], allowed[row], states[i].json_at, grammars)
        if _closing_time(states[i]):
            wanted = int(logits[i].masked_fill(~allowed[row], NEG_INF).argmax())
            for tier in grammars.closing_tokens(logits.shape[-1]):
                closing = allowed[row] & tier
                if closing.any():
                    allowed[row] = closing
                    break
            # The model's own first choice is cut: what the margin closes now is cut short.
            states[i].forced_shut |= not bool(allowed[row, wanted])
        mask[i] = allowed[row]
        states[i].last_mask = allowed[row]
        states[i].forced.append(int(allowed[row].sum()) == 1)
    return logits.masked_fill(~mask, NEG_INF)


def _no_string_opens_with_a_closer(
    logits: Tensor, allowed: Tensor, at: str, grammars: "GrammarCompiler"
) -> None:
    """In a tool call, a JSON string does not begin with `}`, `]`, `)`, `;` or `,`. Small
    models write `"arg": "}}` meaning an empty argument and the end of the call (their quotes
    miscounted), then ramble inside the string they opened. So where the model's choice opens
    a string with one of those (`"}}`, ` ");`), only an empty string (`""`...) may come; where
    a string has just opened and its choice begins with one, only a quote, which closes it
    empty. `allowed` ((V,) bool) changes in place, never to nothing."""
    junk_first, quote_junk, quote_first, empty_string = grammars.closer_tokens(allowed.shape[-1])
    wanted = int(logits.masked_fill(~allowed, NEG_INF).argmax())
    if at in ("value", "outside") and quote_junk[wanted]:
        keep = empty_string if (allowed & empty_string).any() else ~quote_junk
    elif at == "string start" and junk_first[wanted]:
        keep = quote_first
    else:
        return
    if (allowed & keep).any():
        allowed &= keep


def _closing_time(state: SamplerState) -> bool:
    margin = state.params.grammar_close_margin
    return margin > 0 and (state.close_now or state.params.max_tokens - len(state.forced) <= margin)


def _penalize(logits: Tensor, states: Sequence[SamplerState]) -> Tensor:
    """apply_penalties with each row's history stacked to (B, V); rows without one get zeros,
    and so does a tool call's row where an argument's value begins (json_at "value"). There
    the choice is between the value's opening quote, which every earlier value of the call
    opened with (` "`: penalized once per use), and one token that is a whole empty string
    (` "",`: never used): counted, the penalty wrote `"sign1": ""` for "Aries" (BFCL simple, 26 of
    400 replies with an empty argument; 9 with the value's first token left unpenalized)."""
    vocab_size = logits.shape[-1]
    no_seen = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
    no_counts = torch.zeros(vocab_size, dtype=torch.int32, device=logits.device)
    for s in states:
        if s.counts is not None and s.counts.shape[0] != vocab_size:
            raise ValueError(
                f"SamplerState was made for a vocabulary of {s.counts.shape[0]} "
                f"tokens but the logits have {vocab_size}; pass the model's "
                f"logits width as vocab_size"
            )
    bare = [s.seen is None or s.json_at == "value" for s in states]
    seen = torch.stack([no_seen if b else s.seen for s, b in zip(states, bare)])  # (B, V)
    counts = torch.stack([no_counts if b else s.counts for s, b in zip(states, bare)])  # (B, V)
    params = [s.params for s in states]
    return apply_penalties(
        logits,
        seen,
        counts,
        _row_values([p.repetition_penalty for p in params], logits),
        _row_values([p.presence_penalty for p in params], logits),
        _row_values([p.frequency_penalty for p in params], logits),
    )


def _filter(logits: Tensor, params: list[SamplingParams]) -> tuple[Tensor, Tensor | None]:
    """Temperature, top-k, top-p, min-p on (B, V) logits, skipping what no row asks for.

    Returns the filtered logits of each row's candidates and their token ids (B, N); ids None
    where N = V, the whole row. Where every sampled row keeps only a few tokens, those few alone
    are filtered and drawn from (as llama.cpp does): top-k's k, or the few (TOP_P_FIRST) that
    top-p's nucleus nearly always lies among.
    """
    sampled = [p for p in params if not p.is_greedy]
    top_k = [max(p.top_k, 0) for p in params]
    max_k = max(top_k)
    vocab_size = logits.shape[-1]
    if 0 < max_k < vocab_size and all(p.top_k > 0 for p in sampled):
        values, ids = top_candidates(logits, max_k)  # (B, max_k): temperature keeps the order
        return _filter_rows(values, params, top_k, max_k), ids
    if max_k == 0 and all(p.top_p < 1.0 for p in sampled):
        tempered = _temper(logits, params)
        nucleus = top_p_candidates(tempered, _row_values([p.top_p for p in params], logits))
        if nucleus is not None:
            values, ids = nucleus
            return _min_p(values, params), ids
        # else some row is flat enough that its nucleus is sorted out of the whole vocabulary
    return _filter_rows(logits, params, top_k, max_k), None


def _filter_rows(
    logits: Tensor, params: list[SamplingParams], top_k: list[int], max_k: int
) -> Tensor:
    """The filters in order on logits (B, N), N = V or the max_k candidates; all order-agnostic."""
    logits = _temper(logits, params)
    if max_k > 0:
        top_k_tensor = torch.tensor(top_k, dtype=torch.long, device=logits.device)
        logits = top_k_mask(logits, top_k_tensor, max_k)
    if any(p.top_p < 1.0 for p in params):
        logits = top_p_mask(logits, _row_values([p.top_p for p in params], logits))
    return _min_p(logits, params)


def _temper(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    if any(not p.is_greedy and p.temperature != 1.0 for p in params):
        temperature = [0.0 if p.is_greedy else p.temperature for p in params]
        logits = apply_temperature(logits, _row_values(temperature, logits))
    return logits


def _min_p(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    if any(p.min_p > 0.0 for p in params):
        logits = min_p_mask(logits, _row_values([p.min_p for p in params], logits))
    return logits


def _with_logprobs(raw: Tensor, token_ids: Tensor, params: list[SamplingParams]) -> SamplerOutput:
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return SamplerOutput(token_ids)
    # of the raw model distribution: log_softmax(raw), at the chosen and the likeliest n only
    total = logsumexp_rows(raw)  # (B, 1)
    chosen = (raw.gather(1, token_ids[:, None]) - total).squeeze(1)  # (B,)
    values, ids = top_candidates(raw, min(max(asked), raw.shape[-1]))  # (B, n)
    return SamplerOutput(token_ids, chosen, ids, values - total)


def _row_values(values: list[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)  # (B,)


def _check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token ids {bad[:5]} are outside the vocabulary "
            f"(0 ... {vocab_size - 1}); the tokenizer and model do not match"
        )
