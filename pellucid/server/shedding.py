"""LoadShedding: refuses a generation request with 429 (or 503 while stopping) before its body is
read, when the server holds as much as its limits allow.

Under overload most requests are refused; each refusal must cost the server next to nothing, or
the refusals slow the requests it did accept. Past this point a request costs its JSON parse,
validation, chat template and tokenization, so the check comes first.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from pellucid.server.errors import APIError
from pellucid.server.state import ServerState

# the routes that put work on the engine (the explorer's run passes through it too)
GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/inspect", "/v1/patching"}


class LoadShedding:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATING:
            try:
                self.state.check_room()
            except APIError as refusal:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
