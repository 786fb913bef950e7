"""Sequence: everything one request carries through the engine, from prompt ids to finished text."""

from __future__ import annotations

import itertools
from enum import Enum

from pellucid.engine.kv_cache import KVCache
from pellucid.engine.outputs import RequestOutput, Timings, TokenLogprob
from pellucid.engine.sampler import SamplerState
from pellucid.engine.sampling_params import SamplingParams
from pellucid.engine.stop_strings import StopStringFilter
from pellucid.tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # prompt not yet pre-filled
    RUNNING = "running"  # decoding one token per step
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
        self.output_ids: list[int] = []
        self.params = params
        # Stop at EOS / end-of-turn (unless ignored), the caller's stop ids, or a full context.
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else tokenizer.eos_ids)
        self.max_len = max_len
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.sampler_state = SamplerState(params, prompt_ids, vocab_size)
        self.kv: KVCache | None = None  # allocated at pre-fill
        self.timings = Timings(prompt_tokens=len(prompt_ids))
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringFilter(params.stop)
        self.text = ""

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token_id: int) -> str:
        """Add a sampled token; return the text it releases. Sets finish_reason when done."""
        self.output_ids.append(token_id)
        self.sampler_state.update(token_id)
        if token_id in self.stop_ids:
            return self.finish("stop")  # the stop token itself is not shown
        delta = self._stops.feed(self._detok.step(token_id))
        if self._stops.stopped:
            self.text += delta
            self.finish("stop")
            return delta
        self.text += delta
        full = len(self.prompt_ids) + len(self.output_ids) >= self.max_len
        if len(self.output_ids) >= self.params.max_tokens or full:
            return delta + self.finish("length")
        return delta

    def finish(self, reason: str) -> str:
        """Mark the sequence done; return any text held back for a stop string that never came."""
        self.status, self.finish_reason = Status.FINISHED, reason
        self.kv = None  # free the cache now, not when the caller drops the sequence
        tail = "" if self._stops.stopped else self._stops.flush()
        self.text += tail
        return tail

    def output(self, delta: str) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text,
            delta=delta,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            timings=self.timings,
            logprobs=self.logprobs,
        )
