"""Structured output: tools in the prompt, grammars that make calls valid, calls parsed back out."""

from pellucid.structured.chat_request import PreparedChat, prepare_chat, reply_defaults
from pellucid.structured.grammars import response_format_grammar, tool_call_grammar
from pellucid.structured.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

__all__ = [
    "PreparedChat",
    "ToolCall",
    "ToolCallStream",
    "parse_tool_calls",
    "prepare_chat",
    "reply_defaults",
    "response_format_grammar",
    "tool_call_grammar",
]
