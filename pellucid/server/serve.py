"""serve(app): run the server under uvicorn until SIGTERM or Ctrl-C, then stop it gracefully.

On the signal it stops listening and takes no new request (503 with Retry-After on open
connections); what is in flight may finish for `ServerLimits.shutdown_timeout_s`, then it ends with
an error: a stream gets an error event and [DONE], a whole answer a 503. The engine thread stops
with the app, and SIGTERM exits 0, as a stop that was asked for.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pellucid.server.state import ServerState

# uvicorn cancels what is still open this long after the deadline; by then it has all ended
SHUTDOWN_MARGIN_S = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.engine.shut_down(self.state.limits.shutdown_timeout_s)
        await super().shutdown(sockets)


def serve(app: FastAPI, host: str, port: int) -> None:
    state: ServerState = app.state.pellucid
    timeout = state.limits.shutdown_timeout_s + SHUTDOWN_MARGIN_S
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=timeout)
    # uvicorn raises the signal again once it has stopped, with the handler found at its start
    signal.signal(signal.SIGTERM, _exit_cleanly)
    GracefulServer(config, state).run()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
