"""Sequence: everything one request carries through the engine, from prompt ids to finished text."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING

from pellucid.engine.block_filter import BlockFilter
from pellucid.engine.drafter import NgramDrafter
from pellucid.engine.loops import KEEP, is_looping
from pellucid.engine.outputs import RequestOutput, Timings, TokenLogprob
from pellucid.engine.probes import Capture, intervention_key
from pellucid.engine.sampler import SamplerState
from pellucid.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from pellucid.engine.stop_strings import StopStringFilter
from pellucid.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from pellucid.engine.trace_recorder import Recorder

_ids = itertools.count()
# Draws of a reply that must hold a call, after the first whose only call was forced shut
MAX_REDRAWS = 2


class Status(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # has KV blocks; pre-filling in chunks or decoding
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_len: int,
    ):
        self.request_id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)  # prompt + output: what the KV cache must hold
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.arrival = time.perf_counter()
        self.admitted = False  # set by the scheduler at its first step (preemption keeps it)
        self.finish_reason: str | None = None
        # Stop at EOS / end-of-turn (unless ignored), the caller's stop ids, or a full context.
        eos = set() if params.ignore_eos else tokenizer.eos_ids
        self.stop_ids = set(params.stop_token_ids) | eos
        self.max_len = max_len
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached = 0  # of the prompt, tokens found in the prefix cache
        self.block_table: list[int] = []
        self.num_sealed_blocks = 0  # full blocks registered for prefix sharing
        self.sampler_state = SamplerState(params, prompt_ids, vocab_size)
        self.timings = Timings(prompt_tokens=len(prompt_ids))
        self.trace: Recorder | None = None  # set by the engine when the request asks for one
        self.on_output: Callable[[RequestOutput], None] | None = None  # its owner, if it has one
        self.redraw_due = False  # set by append: the engine is to call redraw()
        self.drafter: NgramDrafter | None = None  # set by the engine where it may draft
        self.capture: Capture | None = None  # set by the engine for LLM.run_with_cache
        # KV computed under interventions is shared only with requests under the same ones
        self.cache_salt = intervention_key(params.interventions)
        self._tokenizer = tokenizer
        self._start_reply()

    def _start_reply(self) -> None:
        """The reply's text state, empty: the filters, the detokenizer, the loop watch."""
        self._detok = IncrementalDetokenizer(self._tokenizer)
        self._stops = StopStringFilter(self.params.stop)
        self._blocks = BlockFilter(self.params.distinct_blocks)
        self.text = ""
        # The latest text, watched for a loop where the grammar may close early (loops.py)
        self._recent: str | None = "" if self.params.grammar_close_margin > 0 else None

    @property
    def num_pending(self) -> int:
        """Tokens still to push through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def repeating_block(self) -> bool:
        """Its reply is inside a tagged block that so far repeats an earlier one (BlockFilter)."""
        return self._blocks.repeating

    def append(self, token_id: int) -> str:
        """Add a sampled token; return the text it releases. Sets finish_reason when done."""
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
        self.sampler_state.update(token_id)
        if token_id in self.stop_ids:
            return self.finish(self._stop_reason())  # the stop token itself is not shown
        piece = self._detok.step(token_id)
        self._watch_for_loops(piece)
        delta = self._release(self._stops.feed(piece))
        if self._blocks.forced_block and not self._blocks.seen and self.params.require_block:
            # Its only call was forced shut: the engine draws again, or, where it cannot, the
            # reply keeps that call (finish_reason "length")
            if self._may_redraw():
                self.redraw_due = True
                return delta
            self.text += self._blocks.forced_block
            delta += self._blocks.forced_block
        if self._stops.stopped or self._blocks.ended:
            return delta + self.finish(self._blocks.ended or "stop")
        full = len(self.token_ids) >= self.max_len
        if len(self.output_ids) >= self.params.max_tokens or full:
            return delta + self.finish("length")
        return delta

    def _watch_for_loops(self, piece: str) -> None:
        if self._recent is None or self.sampler_state.close_now or not piece:
            return
        self._recent = (self._recent + piece)[-KEEP:]
        self.sampler_state.close_now = is_looping(self._recent)

    def _may_redraw(self) -> bool:
        """A reply that must hold a call may be drawn again while nobody has seen any of it:
        no token's logprob or trace has gone out, and a new draw can differ (it is sampled)."""
        p = self.params
        temperature = p.temperature if p.redraw_temperature is None else p.redraw_temperature
        return (
            self.timings.redraws < MAX_REDRAWS
            and temperature >= GREEDY_TEMPERATURE
            and p.logprobs is None
            and self.trace is None
        )

    def redraw(self) -> None:
        """Start the reply over from the prompt. The caller frees the KV blocks
        (Scheduler.requeue: the prompt's come back from the prefix cache). The random generator
        draws on, so the new reply differs from the last; it is sampled at redraw_temperature
        where the params name one."""
        if self.params.redraw_temperature is not None:
            self.params = replace(self.params, temperature=self.params.redraw_temperature)
            self.sampler_state.params = self.params
        del self.token_ids[len(self.prompt_ids) :]
        self.output_ids.clear()
        self.sampler_state.restart(self.prompt_ids)
        if self.drafter is not None:
            self.drafter.forget()
        self._start_reply()
        self.timings.redraws += 1
        self.redraw_due = False

    def _release(self, text: str) -> str:
        """Text past the stop strings goes through the block filter, then into the reply."""
        closed = len(self._blocks.seen)
        released = self._blocks.feed(text, forced=self.sampler_state.forced_shut)
        if len(self._blocks.seen) > closed and self.params.penalties_per_block:
            self.sampler_state.forget_counts()
        self.sampler_state.json_at = self._blocks.json_at
        self.sampler_state.close_now |= self._blocks.lost
        self.text += released
        return released

    def _stop_reason(self) -> str:
        # A reply the close margin had to force shut ends on EOS, but it is cut short.
        return "length" if self.sampler_state.forced_shut else "stop"

    def finish(self, reason: str) -> str:
        """Mark the sequence done; return any text held back for a stop string or a block that
        never came."""
        self.status, self.finish_reason = Status.FINISHED, reason
        tail = "" if self._stops.stopped else self._release(self._stops.flush())
        unclosed = self._blocks.flush()
        self.text += unclosed
        tail += unclosed
        if self.trace is not None:
            self.trace.finish(self.text, reason)
        return tail

    def output(self, delta: str, logprob: TokenLogprob | None = None) -> RequestOutput:
        """What this step added (`delta`, the new token's `logprob`), with the whole so far."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text,
            delta=delta,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            timings=self.timings,
            logprobs=None if self.params.logprobs is None else [logprob] if logprob else [],
            forced=list(self.sampler_state.forced) if self.params.grammar is not None else None,
        )
