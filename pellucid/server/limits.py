"""ServerLimits: how much work the server takes on before it answers "later" (HTTP 429), how long a
request may wait for its first step (then 503), and how long a stopping server lets requests finish.

The engine runs up to `EngineConfig.max_num_seqs` sequences at once; `max_waiting` more may queue
behind them. Past that a request is refused at once, so under overload memory stays bounded and
waits do not grow without end. A queued request starts only when a running one finishes, which
can take a whole generation: the queue absorbs bursts, and `max_waiting=0` (refuse as soon as the
batch is full) keeps the time to first token of accepted requests near one step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ServerLimits:
    max_waiting: int = 64  # sequences queued behind the running ones; more: 429
    max_tokens_in_flight: int | None = None  # prompt + max_tokens over sequences held; more: 429
    queue_timeout_s: float | None = 300.0  # not run once after this long: cancelled, 503
    shutdown_timeout_s: float = 30.0  # on SIGTERM, what is in flight may finish for this long
    retry_after_s: int = 1  # the Retry-After of 429 and 503 answers

    def __post_init__(self) -> None:
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be 0 or more, got {self.max_waiting!r}")
        if self.max_tokens_in_flight is not None and self.max_tokens_in_flight < 1:
            raise ValueError(
                f"max_tokens_in_flight must be positive, got {self.max_tokens_in_flight!r}"
            )
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be positive, got {self.queue_timeout_s!r}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(
                f"shutdown_timeout_s must be 0 or more, got {self.shutdown_timeout_s!r}"
            )
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be 0 or more, got {self.retry_after_s!r}")
