"""ServerState: what the request handlers share (the model, its engine thread, metrics, limits,
the names the model answers to, the API key), and the checks that turn into 404 / 429 / 503."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from pellucid import catalog
from pellucid.engine import SamplingParams
from pellucid.llm import LLM
from pellucid.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    QueueTimeoutError,
    RequestHandle,
    ShuttingDownError,
)
from pellucid.server.errors import APIError
from pellucid.server.limits import ServerLimits
from pellucid.server.metrics import ServerMetrics
from pellucid.server.params import Prompt


class ServerState:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None, limits: ServerLimits):
        self.llm, self.model_name, self.api_key, self.limits = llm, model_name, api_key, limits
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name, lambda: self.engine.stats)
        self.engine = AsyncEngine(llm.engine, self.metrics, limits)
        self.metrics.watch_load(lambda: self.engine.in_flight, lambda: self.engine.tokens_in_flight)
        self.names = _accepted_names(llm, model_name)

    def check_model(self, name: str | None) -> None:
        if name is not None and name.lower() not in self.names:
            raise APIError(
                404,
                f"The model '{name}' does not exist: this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def submit(self, prompts: list[Prompt], params: list[list[SamplingParams]]) -> RequestHandle:
        """Queue every choice of every prompt (prompt-major, as OpenAI numbers the choices)."""
        sequences = [(p.ids, sp) for p, per_prompt in zip(prompts, params) for sp in per_prompt]
        if len(sequences) > self.engine.max_sequences:
            raise APIError(
                400,
                f"this request asks for {len(sequences)} sequences (prompts x n) but the "
                f"server holds at most {self.engine.max_sequences} at once: lower n",
                param="n",
            )
        tokens = sum(len(ids) + sp.max_tokens for ids, sp in sequences)
        limit = self.limits.max_tokens_in_flight
        if limit is not None and tokens > limit:
            raise APIError(
                400,
                f"this request needs {tokens} tokens (prompt + max_tokens, over its sequences) "
                f"but the server holds at most {limit} at once: lower max_tokens or n",
                param="max_tokens",
            )
        with self._refusals():
            return self.engine.submit(sequences)

    def check_room(self) -> None:
        """Refuse now if not even one more sequence fits (shedding.py: before the body is read)."""
        with self._refusals():
            self.engine.check_room(1, tokens=0)

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        try:
            yield
        except (QueueFullError, EngineDeadError) as e:
            if isinstance(e, QueueFullError):
                self.metrics.rejected(e.reason)
            elif isinstance(e, ShuttingDownError):
                self.metrics.rejected("shutting_down")
            raise self.error_for(e) from e

    def error_for(self, e: Exception) -> APIError | None:
        """The HTTP answer to the engine thread's refusal or cut-off `e`; None for other errors.
        None of these is the request's fault: 429/503 with Retry-After, so clients come back."""
        for refusal, status, code in (
            (QueueFullError, 429, "rate_limit_exceeded"),
            (QueueTimeoutError, 503, "queue_timeout"),
            (ShuttingDownError, 503, "server_shutting_down"),
        ):
            if isinstance(e, refusal):
                kind = "requests" if status == 429 else "server_error"
                return APIError(
                    status, str(e), kind=kind, code=code, retry_after=self.limits.retry_after_s
                )
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), kind="server_error", code="engine_unavailable")
        return None


def _accepted_names(llm: LLM, model_name: str) -> set[str]:
    """The served name, the file's name (with and without suffix) and the catalog's aliases."""
    names = {model_name, llm.path.name, llm.path.stem}
    entry = catalog.find(model_name)
    if entry is not None:
        names |= {entry.name, *entry.aliases}
    return {n.lower() for n in names}
