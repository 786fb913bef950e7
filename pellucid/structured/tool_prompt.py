"""Tools in the prompt: the tool list, past calls and their results, written into the messages.

A chat template that knows about tools (it reads `tools`, `tool_calls`) gets them as they are.
Most small models' templates do not (SmolLM2, Gemma 3), so the tools go into the system message
and calls and results become plain text in the `<tool_call>` / `<tool_response>` convention.
"""

from __future__ import annotations

import json
from typing import Any

from pellucid.structured.grammars import function_of
from pellucid.structured.tool_calls import CALL_CLOSE, CALL_OPEN

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def tools_instructions(tools: list[dict]) -> str:
    """The system-prompt text that lists the tools and shows how to call one."""
    lines = "\n".join(json.dumps(function_of(t), ensure_ascii=False) for t in tools)
    return (
        "You have tools. Each one is described by a JSON schema inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n"
        f"To use a tool, answer with its name and arguments as JSON inside {CALL_OPEN}"
        f"{CALL_CLOSE} tags, like this:\n"
        f'{CALL_OPEN}\n{{"name": "tool_name", "arguments": {{"argument": "value"}}}}\n'
        f"{CALL_CLOSE}\n"
        f"Each result comes back inside {RESPONSE_OPEN}{RESPONSE_CLOSE} tags."
    )


def messages_with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages a template without tool support can render: every tool turn becomes text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _calls_text(m)})
        elif role == "tool":
            result = f"{RESPONSE_OPEN}\n{_text(m.get('content'))}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_results"):  # several results answer one turn of calls
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
        else:
            out.append({**m, "content": _text(m.get("content"))})
    for m in out:
        m.pop("_results", None)
    if tools:
        out = _with_system(out, tools_instructions(tools))
    return out


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _calls_text(message: dict) -> str:
    blocks = []
    for call in message["tool_calls"]:
        f = call.get("function", call)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"the arguments of the earlier call to {f['name']!r} in the "
                    f"messages are not JSON ({e}): {args[:100]!r}"
                ) from e
        body = json.dumps({"name": f["name"], "arguments": args}, ensure_ascii=False)
        blocks.append(f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}")
    content = _text(message.get("content"))
    return "\n".join([content, *blocks] if content else blocks)


def _text(content: Any) -> str:
    """A message's content as one string: None is empty, OpenAI content parts are joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
