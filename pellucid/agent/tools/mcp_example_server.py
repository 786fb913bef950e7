"""A tiny MCP server over stdio, for tests and demos of `mcp_tools`.

Run: python -m pellucid.agent.tools.mcp_example_server
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("pellucid-example")


@server.tool()
def word_count(text: str) -> int:
    """Count the words (runs of non-space characters) in a text."""
    return len(text.split())


@server.tool()
def reverse(text: str) -> str:
    """Reverse a text, character by character."""
    return text[::-1]


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("cannot divide by zero; pass a non-zero b")  # reaches the client as isError
    return a / b


if __name__ == "__main__":
    server.run()
