"""Tools an LLM agent can call: calculator, search, http, python, and any MCP server's tools.

Each is a `Tool` (a name, a JSON Schema and a function) whose `openai_schema()` goes in a chat
request's `tools` list and whose `tool(arguments)` runs a call the model made.
"""

from __future__ import annotations

from collections.abc import Callable

from .calculator import calculator
from .http_tool import make_http_tool
from .mcp_client import MCPConnection, mcp_tools
from .python_sandbox import make_python_tool
from .search import make_search_tool
from .tool import Tool, ToolError, tool

_BUILTIN: dict[str, Callable[[], Tool]] = {
    "calculator": lambda: calculator,
    "search": make_search_tool,
    "http": make_http_tool,
    "python": make_python_tool,
}


def builtin_tools(names: list[str]) -> list[Tool]:
    """The named built-in tools, with default settings, in the order given."""
    unknown = [name for name in names if name not in _BUILTIN]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; the built-in tools are {list(_BUILTIN)}")
    return [_BUILTIN[name]() for name in names]


__all__ = [
    "MCPConnection",
    "Tool",
    "ToolError",
    "builtin_tools",
    "calculator",
    "make_http_tool",
    "make_python_tool",
    "make_search_tool",
    "mcp_tools",
    "tool",
]
