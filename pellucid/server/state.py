"""ServerState: what the request handlers share (the model, its engine thread, metrics, the
names the model answers to, the API key), and the checks that turn into 404 / 429 / 503."""

from __future__ import annotations

import time

from pellucid import catalog
from pellucid.engine.sampling_params import SamplingParams
from pellucid.llm import LLM
from pellucid.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestHandle
from pellucid.server.errors import APIError
from pellucid.server.metrics import ServerMetrics
from pellucid.server.params import Prompt


class ServerState:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None, max_queue: int):
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name, lambda: self.engine.stats)
        self.engine = AsyncEngine(llm.engine, self.metrics, max_queue)
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
        if len(sequences) > self.engine.max_queue:
            raise APIError(
                400,
                f"this request asks for {len(sequences)} sequences (prompts x n) but the "
                f"server holds at most {self.engine.max_queue} at once: lower n",
                param="n",
            )
        try:
            return self.engine.submit(sequences)
        except QueueFullError as e:
            raise APIError(429, str(e), kind="requests", code="rate_limit_exceeded") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), kind="server_error", code="engine_unavailable") from e


def _accepted_names(llm: LLM, model_name: str) -> set[str]:
    """The served name, the file's name (with and without suffix) and the catalog's aliases."""
    names = {model_name, llm.path.name, llm.path.stem}
    entry = catalog.find(model_name)
    if entry is not None:
        names |= {entry.name, *entry.aliases}
    return {n.lower() for n in names}
