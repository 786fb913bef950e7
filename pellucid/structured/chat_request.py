"""prepare_chat: messages + tools + tool_choice + response_format -> the prompt and its grammar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pellucid.structured.grammars import (
    response_format_grammar,
    tool_call_grammar,
    tool_choice_name,
)
from pellucid.structured.tool_prompt import messages_with_tools
from pellucid.tokenizer import Tokenizer


@dataclass(slots=True)
class PreparedChat:
    prompt: str  # the rendered chat, ready to tokenize with parse_special=True
    grammar: str | None  # for SamplingParams.grammar; None: unconstrained
    parse_calls: bool  # the reply may hold <tool_call> blocks to parse out


def prepare_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    tool_choice: str | dict = "auto",
    parallel_tool_calls: bool = True,
    response_format: dict[str, Any] | None = None,
    constrained: bool = True,
) -> PreparedChat:
    """Render the prompt; `constrained=False` leaves the grammar off (to measure what it buys).

    With tools in play (tool_choice not "none"), the tool grammar decides the reply's shape and
    response_format applies only to replies without tools.
    """
    tools = tools or []
    choice = tool_choice_name(tools, tool_choice)
    active = tools if choice != "none" else []
    if active and _template_has_tools(tokenizer):
        prompt = tokenizer.apply_chat_template(messages, tools=active)
    else:
        prompt = tokenizer.apply_chat_template(messages_with_tools(messages, active))
    if active:
        grammar = tool_call_grammar(active, tool_choice, parallel_tool_calls)
    else:
        grammar = response_format_grammar(response_format)
    return PreparedChat(prompt, grammar if constrained else None, bool(active))


def _template_has_tools(tokenizer: Tokenizer) -> bool:
    return tokenizer.chat_template is not None and "tools" in tokenizer.chat_template
