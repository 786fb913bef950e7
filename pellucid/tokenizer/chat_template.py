"""Render a model's Jinja chat template exactly as Hugging Face's `apply_chat_template` does.

The same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, `{% generation %}`),
the same `tojson` filter and `raise_exception` / `strftime_now` globals, and the same variables:
messages, tools, documents, add_generation_prompt, bos_token, eos_token, and any extra keyword.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pellucid.errors import ModelLoadError, PromptError


class ChatTemplate:
    """A compiled chat template; `render` turns messages into the prompt the model was tuned on."""

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None):
        self.source = source
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(
                f"the model's chat template is not valid Jinja (line {e.lineno}: {e})"
            ) from e

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special, **template_kwargs},
            )
        except jinja2.TemplateError as e:
            raise PromptError(f"the model's chat template rejected these messages: {e}") from e


# An assistant turn of two calls, for renders_parallel_calls: tools described in full (some
# templates print every field), call ids of 9 characters (Mistral's templates ask for them)
_PROBE_NAMES = ("probe_alpha", "probe_beta")
_PROBE_PARAMETERS = {
    "type": "object",
    "properties": {"text": {"type": "string", "description": "Some text."}},
    "required": ["text"],
}
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": "A probe.", "parameters": _PROBE_PARAMETERS},
    }
    for n in _PROBE_NAMES
]


def _probe(arguments: Any) -> list[dict[str, Any]]:
    calls = [
        {"id": f"call{i}____", "type": "function", "function": {"name": n, "arguments": arguments}}
        for i, n in enumerate(_PROBE_NAMES)
    ]
    return [
        {"role": "user", "content": "Call both."},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]


@functools.lru_cache(maxsize=16)
def renders_parallel_calls(source: str) -> bool:
    """Whether a chat template writes out an assistant turn of two tool calls: a model tuned on
    such turns makes several calls in one reply (llama.cpp's server reads its template's
    capabilities the same way, and allows parallel calls by default only where it does). The
    calls' arguments go in as an object, then as a JSON string (templates take one or the
    other); a template that fails on both does not (Llama 3.1's raises on more than one call)."""
    template = ChatTemplate(source, bos_token="", eos_token="")
    for arguments in ({"text": "a"}, '{"text": "a"}'):
        try:
            text = template.render(
                _probe(arguments), tools=_PROBE_TOOLS, add_generation_prompt=False
            )
        except Exception:  # noqa: BLE001, S112 - a failure to render them is a "no"
            continue
        return all(name in text for name in _PROBE_NAMES)
    return False


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks; the
    text itself renders unchanged, which is all a prompt needs."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson  # Jinja's own escapes HTML characters; HF's does not
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list):
        raise PromptError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, "
            f"not {type(messages).__name__}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise PromptError(
                f"message {i} must be a dict with a 'role' (and usually 'content'), got {m!r}"
            )
