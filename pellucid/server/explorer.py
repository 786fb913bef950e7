"""The explorer's routes (pellucid's extension, under /v1 behind the API key): what the page at /
asks for beside chat completions.

    GET  /v1/explorer   the model's shape and the machine's limits (measured on the first call)
    POST /v1/inspect    one position of a text: attention rows at every layer and head, logit lens
    POST /v1/patching   activation patching of a clean / corrupted prompt pair: the heatmap

Each pass they need is a request to the same engine, run from a worker thread between the
server's steps, so the event loop and the other requests go on.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from pellucid.engine import model_info
from pellucid.llm import LLM
from pellucid.probing import activation_patching, inspect_position, interventions_from_json
from pellucid.server.errors import bad_request
from pellucid.server.protocol import InspectRequest, PatchingRequest
from pellucid.server.state import ServerState
from pellucid.trace.explain import measure_bandwidth, measure_flops

# A patching sweep runs (layers x positions) passes: prompts are kept short
MAX_PATCHING_TOKENS = 32


def add_explorer_routes(router: APIRouter, state: ServerState) -> None:
    limits: dict[str, float] = {}

    @router.get("/explorer")
    async def explorer() -> dict[str, Any]:
        if not limits:  # once: a fraction of a second of copying and multiplying
            limits["bandwidth_gbs"] = await asyncio.to_thread(measure_bandwidth, 64)
            limits["flops"] = await asyncio.to_thread(measure_flops, state.llm.matmul_dtype)
        return {"model": state.model_name, **model_facts(state.llm), "limits": limits}

    @router.post("/inspect")
    async def inspect(body: InspectRequest) -> dict[str, Any]:
        state.check_model(body.model)
        vocab = state.llm.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise bad_request(f"tokens must be ids in 0..{vocab - 1}", "tokens")
        if body.position + 1 >= state.llm.engine.max_model_len:  # as a prompt, +1 to generate
            raise bad_request(
                f"position must be below {state.llm.engine.max_model_len - 1}", "position"
            )
        if body.position >= len(body.tokens):
            raise bad_request(
                f"position {body.position} is outside the text: 0..{len(body.tokens) - 1}",
                "position",
            )
        return await asyncio.to_thread(_inspect, state.llm, body)

    @router.post("/patching")
    async def patching(body: PatchingRequest) -> dict[str, Any]:
        state.check_model(body.model)
        n = len(state.llm.encode(body.clean))
        if n > MAX_PATCHING_TOKENS:
            raise bad_request(
                f"the clean prompt has {n} tokens; patching takes at most {MAX_PATCHING_TOKENS} "
                "(it runs the model once per layer and position)",
                "clean",
            )
        try:
            p = await asyncio.to_thread(
                activation_patching, state.llm, body.clean, body.corrupted, body.site
            )
        except ValueError as e:
            raise bad_request(str(e), "corrupted") from e
        return {
            "site": p.site,
            "tokens": p.tokens,
            "answers": list(p.answers),
            "clean": p.clean,
            "corrupted": p.corrupted,
            "scores": p.scores.tolist(),
        }


def _inspect(llm: LLM, body: InspectRequest) -> dict[str, Any]:
    try:
        edits = interventions_from_json(llm, body.interventions or [], body.tokens)
    except ValueError as e:
        raise bad_request(str(e), "interventions") from e
    return inspect_position(llm, body.tokens, body.position, edits, body.top_k)


def model_facts(llm: LLM) -> dict[str, Any]:
    """The shape the page draws, and the work per token it sets against the machine's limits."""
    return {
        **model_info(llm.model).shape(),
        "max_model_len": llm.engine.max_model_len,
        "kv_bytes_per_token": llm.engine.pool.bytes_per_token,
    }
