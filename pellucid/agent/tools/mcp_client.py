"""Tools from an MCP server: start it over stdio, list its tools, call them from synchronous code.

The `mcp` client is async and its session must outlive single calls, so an `MCPConnection` runs
it in a background thread with its own event loop and hands each call over with
`asyncio.run_coroutine_threadsafe`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import re
import shlex
import tempfile
import threading
from typing import Any, Self

import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from .tool import Tool, ToolError


class MCPConnection:
    """A running MCP server and its tools; close it (or use `with`) to stop the server."""

    def __init__(self, command: list[str], env: dict | None = None, timeout_s: float = 60) -> None:
        if not command:
            raise ValueError("an MCP server command is needed, e.g. ['python', '-m', 'my_server']")
        self.command, self.timeout_s = list(command), timeout_s
        self._name = shlex.join(self.command)
        # The server's stderr (logs, tracebacks) goes to a file, shown if it fails to start.
        self._stderr = tempfile.TemporaryFile(  # noqa: SIM115 - lives as long as the server
            mode="w+", encoding="utf-8", errors="replace"
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp {self._name}")
        self._thread.daemon = True  # a forgotten connection must not keep the process alive
        self._thread.start()
        self._client: Client | None = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()  # binds to the loop that first waits on it
        ready: concurrent.futures.Future[list[mcp_types.Tool]] = concurrent.futures.Future()
        params = StdioServerParameters(command=command[0], args=command[1:], env=env)
        self._session = asyncio.run_coroutine_threadsafe(self._run(params, ready), self._loop)
        try:
            listed = ready.result(timeout=timeout_s)
        except Exception as e:
            message = self._startup_error(e)
            self.close()
            raise RuntimeError(message) from e
        except BaseException:  # Ctrl-C while starting: still stop the server
            self.close()
            raise
        self.tools = [self._tool(t) for t in listed]
        atexit.register(self.close)

    async def _run(self, params: StdioServerParameters, ready: concurrent.futures.Future) -> None:
        """The session's whole life in one task, as anyio's cancel scopes require."""
        self._task = asyncio.current_task()
        try:
            async with Client(stdio_client(params, errlog=self._stderr)) as client:
                listed, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    listed += page.tools
                    if not (cursor := page.next_cursor):
                        break
                self._client = client
                ready.set_result(listed)
                await self._stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            else:
                raise
        finally:
            self._client = None

    def _tool(self, spec: mcp_types.Tool) -> Tool:
        def call(**arguments: Any) -> str:
            return self.call(spec.name, arguments)

        # OpenAI allows [A-Za-z0-9_-] in names; MCP also allows dots and slashes.
        name = re.sub(r"[^A-Za-z0-9_-]", "_", spec.name)[:64]
        schema = spec.input_schema or {"type": "object", "properties": {}}
        return Tool(name=name, description=spec.description or "", parameters=schema, fn=call)

    def call(self, name: str, arguments: dict) -> str:
        """Call the server's tool `name`; its text content, or a ToolError if it reports one."""
        client = self._client
        if client is None:
            raise ToolError(f"{name}: the MCP server {self._name} is not running")
        future = asyncio.run_coroutine_threadsafe(client.call_tool(name, arguments), self._loop)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolError(
                f"{name}: no answer from the MCP server in {self.timeout_s:g} s"
            ) from None
        texts = [c.text if c.type == "text" else f"[{c.type} content]" for c in result.content]
        text = "\n".join(texts)
        if result.is_error:
            raise ToolError(f"{name}: {text or 'the MCP server reported an error'}")
        if not text and result.structured_content is not None:
            return json.dumps(result.structured_content)
        return text

    def close(self) -> None:
        """Stop the server and the event loop thread; safe to call twice."""
        atexit.unregister(self.close)
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=15)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self._stderr.close()

    async def _shutdown(self) -> None:
        self._stop.set()
        if self._task is None:
            return
        if self._client is None:
            self._task.cancel()  # still starting: interrupt the handshake
        # Wait for the task itself: stdio_client's cleanup is what stops (or kills) the server.
        await asyncio.wait({self._task}, timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _startup_error(self, error: BaseException) -> str:
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]  # anyio nests the one real failure in task groups
        if isinstance(error, FileNotFoundError):
            why = f"{self.command[0]!r} was not found"
        elif "Connection closed" in str(error):
            why = "it exited, or closed its stdout, before the MCP handshake"
        elif isinstance(error, concurrent.futures.TimeoutError):
            why = f"no handshake within {self.timeout_s:g} s"
        else:
            why = f"{type(error).__name__}: {error}"
        self._stderr.seek(0)
        stderr = self._stderr.read()[-2000:].strip()
        return f"MCP server {self._name} failed to start ({why})" + (
            f"; its stderr ends with:\n{stderr}" if stderr else ""
        )


def mcp_tools(command: list[str], env: dict | None = None) -> list[Tool]:
    """The tools of the MCP server started by `command`, e.g. ["npx", "some-mcp-server"].

    The server runs until the process exits; use MCPConnection directly to stop it earlier.
    """
    return MCPConnection(command, env).tools
