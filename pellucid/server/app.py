"""The OpenAI-compatible HTTP server: `create_app(llm)` returns a FastAPI app; uvicorn serves it.

    app = create_app(LLM("smollm2-135m"), api_key="secret", model_name="smollm2-135m")
    uvicorn.run(app, host="127.0.0.1", port=8000)     # or: pellucid serve

Routes: /v1/chat/completions, /v1/completions, /v1/models, /v1/tokenize, /v1/detokenize
(also at the root, as vLLM has them, with /tokenizer_info), /health, /metrics, / (the explorer
page) and the routes it asks (explorer.py: /v1/explorer, /v1/inspect, /v1/patching).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from pellucid.llm import LLM
from pellucid.server import completions
from pellucid.server.errors import APIError, bad_request, error_body, install_error_handlers
from pellucid.server.explorer import add_explorer_routes
from pellucid.server.limits import ServerLimits
from pellucid.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pellucid.server.shedding import LoadShedding
from pellucid.server.state import ServerState
from pellucid.trace import html

# Module level: FastAPI resolves the (string) annotations of dependencies in module globals.
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}


def create_app(
    llm: LLM,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    state = ServerState(llm, model_name or llm.path.name, api_key or None, limits or ServerLimits())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:  # uvicorn is stopping: stop the engine thread with it
            state.engine.stop()

    app = FastAPI(title="pellucid", summary="OpenAI-compatible API of pellucid", lifespan=lifespan)
    app.state.pellucid = state
    install_error_handlers(app)
    app.add_middleware(LoadShedding, state=state)
    app.include_router(_v1_router(state))
    # vLLM serves these at the root too; lm-evaluation-harness's remote tokenizer asks there
    root = APIRouter(responses=ERRORS, dependencies=_key_check(state))
    add_tokenizer_routes(root, state)

    @root.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return state.llm.tokenizer.config() | {"model_max_length": state.llm.engine.max_model_len}

    app.include_router(root)
    _add_monitoring_routes(app, state)
    return app


def _key_check(state: ServerState) -> list:
    """The dependency that refuses a request without the server's API key (none if it has none)."""

    async def check_key(creds: Credentials) -> None:
        given = creds.credentials if creds is not None else ""
        if not secrets.compare_digest(given.encode(), (state.api_key or "").encode()):
            raise APIError(
                401,
                "Incorrect API key provided: pass it as 'Authorization: Bearer "
                "KEY' (the key the server was started with)",
                code="invalid_api_key",
            )

    return [Depends(check_key)] if state.api_key else []


def _v1_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", responses=ERRORS, dependencies=_key_check(state))

    @router.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[_card(state)])

    @router.get("/models/{model}")
    async def get_model(model: str) -> ModelCard:
        state.check_model(model)
        return _card(state)

    @router.post("/chat/completions", response_model=None, responses=_ok(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        return await completions.chat(state, body, request)

    @router.post("/completions", response_model=None, responses=_ok(CompletionResponse))
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        return await completions.text(state, body, request)

    add_tokenizer_routes(router, state)
    add_explorer_routes(router, state)
    return router


def add_tokenizer_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        tok = state.llm.tokenizer
        ids = tok.encode(body.prompt, add_special=body.add_special_tokens, parse_special=True)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=state.llm.engine.max_model_len,
            tokens=ids,
            pieces=[tok.id_to_piece(i) for i in ids],
        )

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        vocab = state.llm.model.cfg.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"tokens {bad[:5]} are outside the vocabulary (0..{vocab - 1})", "tokens"
            )
        return DetokenizeResponse(prompt=state.llm.tokenizer.decode(body.tokens))


def _ok(model: type) -> dict[int | str, dict]:
    """Documents the 200 body in /openapi.json: the object, or with `stream` SSE chunks."""
    return {200: {"model": model, "description": "the completion; with stream: text/event-stream"}}


def _card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.model_name, created=state.created, max_model_len=state.llm.engine.max_model_len
    )


def _add_monitoring_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> JSONResponse:
        if not state.engine.is_running:
            return JSONResponse(error_body("the engine thread is not running", "server_error"), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/", response_class=HTMLResponse)
    async def web_view() -> HTMLResponse:
        return HTMLResponse(html.web_view(state.model_name))

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
