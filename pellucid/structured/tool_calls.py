"""Tool calls in model text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

The Hermes / Qwen convention, which small open models are tuned on. `parse_tool_calls` reads a
finished reply; `ToolCallStream` splits a stream into plain-text deltas and whole calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def args(self) -> dict:
        return json.loads(self.arguments)

    @property
    def key(self) -> tuple[str, str]:
        """Name and arguments with keys sorted: two calls with equal keys do the same thing."""
        return self.name, json.dumps(self.args, sort_keys=True)

    def openai(self) -> dict:
        """The entry of an assistant message's `tool_calls` list."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedReply:
    content: str  # the text outside the calls
    tool_calls: list[ToolCall]
    errors: list[str]  # one line per block that was not a valid call


def parse_tool_calls(text: str) -> ParsedReply:
    """Split a reply into its text and its calls; a malformed block stays in the text, and a call
    that repeats an earlier one (same name and arguments) is dropped: running it twice is never
    what the model meant (the engine already ends a reply at a word-for-word repeat)."""
    calls, errors, kept, pos, seen = [], [], [], 0, set()
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        block = _block_at(text, start, final=True)
        if block is None:  # opened and never closed: the reply was cut off mid-call
            errors.append("a <tool_call> block was not closed (the reply hit its token limit?)")
            break
        end, call, error = block
        kept.append(text[pos:start])
        if call is None:
            errors.append(error)
            kept.append(text[start:end])
        elif call.key not in seen:
            seen.add(call.key)
            calls.append(call)
        pos = end
    kept.append(text[pos:])
    return ParsedReply("".join(kept).strip(), calls, errors)


def _block_at(text: str, start: int, final: bool) -> tuple[int, ToolCall | None, str] | None:
    """The block that opens at `start`: (its end, the call or None, why not); None while it is
    not closed yet. The JSON is read first, so a `</tool_call>` inside one of its strings (code
    for a python tool, say) does not end the block; a body that is not JSON ends at the first tag.
    Mid-stream (not final), JSON that may still be growing waits for more text."""
    body = start + len(CALL_OPEN)
    i = _skip_space(text, body)
    try:
        _, j = _JSON.raw_decode(text, i)
    except json.JSONDecodeError as e:
        if not final and (e.msg.startswith("Unterminated string") or e.pos >= len(text)):
            return None
    else:
        k = _skip_space(text, j)
        if text.startswith(CALL_CLOSE, k):
            return k + len(CALL_CLOSE), *_read_call(text[body:k])
        if not final and CALL_CLOSE.startswith(text[k:]):  # the tag is still arriving
            return None
    close = text.find(CALL_CLOSE, body)
    if close < 0:
        return None
    return close + len(CALL_CLOSE), *_read_call(text[body:close])


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _read_call(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"tool call is not valid JSON ({e}): {body.strip()[:200]}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f"tool call has no string 'name': {body.strip()[:200]}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"arguments of {obj['name']} are not a JSON object: {args[:200]}"
    if not isinstance(args, dict):
        return None, f"arguments of {obj['name']} are not a JSON object: {args!r:.200}"
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)), ""


class ToolCallStream:
    """Feed text deltas; get back text that is surely not part of a call, and finished calls.

    Text that might be the start of `<tool_call>` is held until it is known either way, so a
    client never sees half a tag. Everything after an opening tag is held until its closing tag.
    A call that repeats an earlier one is dropped, as in `parse_tool_calls`.
    """

    def __init__(self) -> None:
        self._held = ""
        self._seen: set[tuple[str, str]] = set()

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._held += delta
        text, calls = [], []
        while True:
            start = self._held.find(CALL_OPEN)
            if start < 0:
                safe = _safe_prefix_len(self._held, CALL_OPEN)
                text.append(self._held[:safe])
                self._held = self._held[safe:]
                break
            text.append(self._held[:start])
            block = _block_at(self._held, start, final=False)
            if block is None:
                self._held = self._held[start:]
                break
            end, call, _ = block
            if call is None:
                text.append(self._held[start:end])
            elif call.key not in self._seen:
                self._seen.add(call.key)
                calls.append(call)
            self._held = self._held[end:]
        return "".join(text), calls

    def flush(self) -> str:
        """At the end of the stream: what is still held goes out as text."""
        held, self._held = self._held, ""
        return held


def _safe_prefix_len(text: str, tag: str) -> int:
    """Length of the prefix of text that cannot be the beginning of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return len(text) - n
    return len(text)
