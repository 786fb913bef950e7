"""AsyncEngine: the LLMEngine in one background thread, fed by the server's asyncio handlers.

`step()` is synchronous, CPU-heavy and not safe to call while another thread adds or aborts, so
one thread owns the engine: handlers put adds and aborts on a thread-safe queue, the thread applies
them between steps and hands every RequestOutput back to the handler's asyncio queue with
`loop.call_soon_threadsafe`. A handle that is left before its sequences finish aborts them.

Admission (ServerLimits) is decided on the event loop, which knows exactly what it has handed
over and not yet seen finish: sequences and their tokens (prompt + max_tokens) in flight.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Self

from pellucid.engine import EngineStats, LLMEngine, Recorder, RequestOutput, SamplingParams
from pellucid.server.limits import ServerLimits
from pellucid.server.metrics import ServerMetrics

log = logging.getLogger("pellucid.server")


class QueueFullError(Exception):
    """The server already holds what its limits allow: the client should retry later."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason  # "queue_full" or "tokens_full", for the rejections metric


class EngineDeadError(Exception):
    """The engine thread is not running (stopped, or crashed): nothing can be served."""


class ShuttingDownError(EngineDeadError):
    """The server is stopping: it takes nothing new, and cuts off what outlasts its deadline."""


class QueueTimeoutError(Exception):
    """A sequence waited longer than the queue timeout without being run once."""


@dataclass(slots=True)
class _Add:
    handle: RequestHandle
    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    handle: RequestHandle


@dataclass(slots=True)
class _FailAll:
    error: BaseException


Command = _Add | _Abort | _FailAll  # what the event loop sends the engine thread (None: stop)


class RequestHandle:
    """The sequences of one HTTP request (n choices, or several prompts), read as one stream.

    `async with handle:` then `async for index, output in handle:`. Each output carries only the
    logprobs of its new tokens. Leaving the block early (a client disconnect cancels the handler)
    aborts whatever has not finished, which frees its KV blocks.
    """

    def __init__(self, engine: AsyncEngine, tokens: list[int], loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        # Touched by the event loop only:
        self.unfinished = set(range(len(tokens)))
        self.tokens = tokens  # per choice: prompt + max_tokens, what it may hold of the KV cache
        self.arrival = time.perf_counter()
        self._last_token_at: dict[int, float] = {}
        self._tokens: dict[int, int] = {}
        # Touched by the engine thread only:
        self.request_ids: dict[int, int] = {}  # choice index -> engine request id
        self.traces: dict[int, Recorder] = {}  # choice index -> its trace, when asked for

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def abort(self) -> None:
        """Abort the sequences that have not finished (safe to call twice, or when all are done)."""
        if self.unfinished:
            self.unfinished.clear()
            self.engine.put(_Abort(self))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.unfinished:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            self._observe(index, item)
            if item.finished:
                self.unfinished.discard(index)
            yield index, item

    def _observe(self, index: int, out: RequestOutput) -> None:
        """Time to first token, inter-token latency and finished-request counters."""
        now, metrics = time.perf_counter(), self.engine.metrics
        new = len(out.token_ids) - self._tokens.get(index, 0)
        self._tokens[index] = len(out.token_ids)
        if new > 0 and index not in self._last_token_at:
            metrics.first_token(now - self.arrival)
        elif new > 0:
            metrics.inter_token((now - self._last_token_at[index]) / new, new)
        if new > 0:
            self._last_token_at[index] = now
        if out.finished:
            metrics.finished(out, now - self.arrival)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, limits: ServerLimits):
        self.engine, self.metrics, self.limits = engine, metrics, limits
        self.max_sequences = engine.config.max_num_seqs + limits.max_waiting  # in flight, at most
        self.accepting = True  # False once the server begins to shut down
        self.stats: EngineStats = engine.stats()  # a snapshot the thread refreshes every turn
        # Held while the thread touches the engine; LLM calls on the same model take it too, and
        # run between the thread's turns.
        self.lock = engine.lock
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._owners: dict[int, tuple[RequestHandle, int]] = {}  # engine request id -> handle
        self._handles: set[RequestHandle] = set()  # event loop only: for the in-flight count
        self._thread: threading.Thread | None = None

    # --- event loop side ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="pellucid-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout)
        # Requests queued after the stop command would wait forever: answer them.
        for command in self._take_commands(block=False):
            if isinstance(command, _Add):
                self._deliver(command.handle, command.index, EngineDeadError("server stopped"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Sequences handed to the engine thread and not yet seen finish (running or waiting)."""
        return sum(len(h.unfinished) for h in self._live())

    @property
    def tokens_in_flight(self) -> int:
        return sum(h.tokens[i] for h in self._live() for i in h.unfinished)

    def _live(self) -> set[RequestHandle]:
        self._handles = {h for h in self._handles if h.unfinished}
        return self._handles

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> RequestHandle:
        """Queue the sequences of one request; raises QueueFullError or EngineDeadError."""
        tokens = [len(ids) + params.max_tokens for ids, params in requests]
        self.check_room(len(requests), sum(tokens))
        handle = RequestHandle(self, tokens, asyncio.get_running_loop())
        self._handles.add(handle)
        for index, (ids, params) in enumerate(requests):
            self.put(_Add(handle, index, ids, params))
        return handle

    def check_room(self, sequences: int, tokens: int) -> None:
        """Raise unless the engine runs and `sequences` holding `tokens` fit within the limits."""
        if not self.accepting:
            raise ShuttingDownError(
                "the server is shutting down: send the request elsewhere or retry once it is back"
            )
        if not self.is_running:
            raise EngineDeadError("the engine is not running (the server is stopping or crashed)")
        held = self.in_flight
        if held + sequences > self.max_sequences:
            raise QueueFullError(
                f"the server is busy: it runs {self.engine.config.max_num_seqs} sequences at once "
                f"and queues {self.limits.max_waiting} more, and holds {held} now: retry shortly",
                "queue_full",
            )
        limit = self.limits.max_tokens_in_flight
        if limit is not None and held and (holding := self.tokens_in_flight) + tokens > limit:
            raise QueueFullError(
                f"the server is busy: its requests in flight hold {holding} "
                f"tokens (prompt + max_tokens) of at most {limit}, and this one needs {tokens}: "
                "retry shortly, or lower max_tokens",
                "tokens_full",
            )

    def put(self, command: Command) -> None:
        self._commands.put(command)

    def shut_down(self, deadline_s: float) -> None:
        """Take nothing new; what is still in flight after `deadline_s` ends with an error."""
        self.accepting = False
        error = ShuttingDownError(
            f"the server is shutting down: this request was cut off after {deadline_s:g} s"
        )
        asyncio.get_running_loop().call_later(deadline_s, self.put, _FailAll(error))

    # --- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        busy = False
        while True:
            commands = self._take_commands(block=not busy)
            with self.lock:
                for command in commands:
                    if command is not None:
                        self._apply(command)
                if None in commands:  # stop: fail whatever is still in flight
                    self._fail_all(EngineDeadError("the server is shutting down"))
                    self.stats = self.engine.stats()
                    return
                self._expire_queued()
                if self.engine.has_unfinished():
                    self._step()
                busy = self.engine.has_unfinished()
                self.stats = self.engine.stats()

    def _take_commands(self, block: bool) -> list[Command | None]:
        """Everything queued up to a stop command (None), waiting for one first when idle."""
        commands = []
        try:
            commands.append(self._commands.get() if block else self._commands.get_nowait())
            while commands[-1] is not None:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _apply(self, command: Command) -> None:
        if isinstance(command, _FailAll):
            self._fail_all(command.error)
            return
        handle = command.handle
        if isinstance(command, _Abort):
            for request_id in handle.request_ids.values():
                if self._owners.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
            return
        deliver = functools.partial(self._on_output, handle, command.index)
        try:
            seq = self.engine.add_request(command.prompt_ids, command.params, deliver)
        except Exception as e:  # noqa: BLE001 - the handler validated; tell it what still failed
            self._deliver(handle, command.index, e)
            return
        handle.request_ids[command.index] = seq.request_id
        if seq.trace is not None:
            handle.traces[command.index] = seq.trace
        self._owners[seq.request_id] = (handle, command.index)

    def _expire_queued(self) -> None:
        """Cancel sequences that waited past the queue timeout without a step (blocks freed)."""
        timeout = self.limits.queue_timeout_s
        if timeout is None:
            return
        for request_id in self.engine.abort_queued_longer_than(timeout):
            owner = self._owners.pop(request_id, None)
            if owner is None:  # not a server request (a borrowed engine's)
                continue
            handle, index = owner
            self.metrics.rejected("queue_timeout")
            error = QueueTimeoutError(
                f"the request waited {timeout:g} s in the queue without "
                "being started: the server is overloaded, retry later"
            )
            self._deliver(handle, index, error)

    def _step(self) -> None:
        try:
            self.engine.step()  # outputs reach their handles through _on_output
        except Exception as e:  # keep serving: fail the requests in this batch
            log.exception("engine step failed")
            self._fail_all(e)

    def _on_output(self, handle: RequestHandle, index: int, out: RequestOutput) -> None:
        """An output of a server request, from whichever thread stepped (under the lock)."""
        if self._owners.get(out.request_id) is None:  # aborted meanwhile
            return
        if out.finished:
            del self._owners[out.request_id]
        self._deliver(handle, index, out)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, (handle, index) in list(self._owners.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be broken; the request fails anyway
                log.exception("abort failed")
            self._deliver(handle, index, error)
        self._owners.clear()

    @staticmethod
    def _deliver(handle: RequestHandle, index: int, item: RequestOutput | BaseException) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
