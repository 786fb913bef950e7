"""What the engine hands back after each step: text deltas, token ids, finish reason, timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pellucid.structured import ToolCall


@dataclass(slots=True)
class Timings:
    """Measured on this run: how long pre-fill took and how fast decoding went."""

    prompt_tokens: int = 0
    queued_s: float = 0.0  # from arrival to the first step that ran it
    prefill_s: float = 0.0  # one parallel forward pass over the whole prompt
    decode_tokens: int = 0  # tokens produced by decode steps (the first comes from pre-fill)
    decode_s: float = 0.0
    redraws: int = 0  # times the reply was drawn again from the prompt (Sequence.redraw)
    # Speculative decoding (engine/drafter.py): guesses pushed through the model (those after
    # the first refused one go unchecked), and those the model took
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def summary(self) -> str:
        return (
            f"{self.prompt_tokens} prompt tokens, pre-fill {self.prefill_s * 1000:.0f} ms "
            f"({self.prefill_tokens_per_s:.0f} tok/s), decode {self.decode_tokens} tokens at "
            f"{self.decode_tokens_per_s:.1f} tok/s"
            + (
                f", {self.accepted_tokens} of {self.draft_tokens} drafted tokens taken"
                if self.draft_tokens
                else ""
            )
        )


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives: (token id, logprob)


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated so far, stop strings removed
    delta: str  # new text since the previous output of this request
    finished: bool
    finish_reason: str | None  # "stop" (EOS, stop token or string) | "length" | "abort"
    timings: Timings
    # of the tokens new in this output (LLM.generate and LLM.chat gather all of them)
    logprobs: list[TokenLogprob] | None = field(default=None)
    forced: list[bool] | None = None  # with a grammar: token i was the only one it allowed
    tool_calls: list[ToolCall] = field(default_factory=list)  # filled by LLM.chat(tools=...)


@dataclass(slots=True)
class EngineStats:
    """A snapshot for monitoring (the server's /metrics): queues and KV cache use."""

    running: int  # sequences decoding
    waiting: int  # sequences not yet pre-filled
    kv_used_tokens: int  # token slots of the KV cache holding keys/values now
    kv_capacity_tokens: int  # token slots that exist (allocated or in the pool)
    kv_cached_tokens: int = 0  # slots of free blocks kept for prefix reuse
    kv_resident_tokens: int = 0  # slots written at least once: what the pool holds in RAM
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found already cached

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
