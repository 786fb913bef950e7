"""A `Tool` an LLM agent can call: a name, a JSON Schema for its arguments, and a function.

`@tool` builds one from a typed, documented function; `Tool(arguments)` validates the model's
arguments (a dict or a JSON string) and returns text, raising `ToolError` with a message the model
can act on.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator, ValidationError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI API accepts as a function name
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


class ToolError(Exception):
    """A tool call failed; the message is written for the model to read and correct its call."""


@dataclass(slots=True)
class Tool:
    """A callable tool: `parameters` is a JSON Schema object describing `fn`'s keyword arguments."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]
    _validator: Draft202012Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match {_NAME.pattern} (OpenAI's rule)")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON Schema of type object")
        Draft202012Validator.check_schema(self.parameters)
        self._validator = Draft202012Validator(self.parameters)

    def openai_schema(self) -> dict:
        """The entry for the `tools` list of an OpenAI chat completion request."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": function | {"parameters": self.parameters}}

    def __call__(self, arguments: dict | str) -> str:
        kwargs = self._parse(arguments)
        try:
            result = self.fn(**kwargs)
        except ToolError:
            raise  # already written for the model
        except Exception as e:
            raise ToolError(f"{self.name} failed: {e}") from e
        return result if isinstance(result, str) else json.dumps(result, default=str)

    def _parse(self, arguments: dict | str) -> dict:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ToolError(f"{self.name}: arguments are not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object, got {arguments!r}")
        error = next(iter(sorted(self._validator.iter_errors(arguments), key=_depth)), None)
        if error is not None:
            raise ToolError(self._explain(error, arguments))
        return arguments

    def _explain(self, error: ValidationError, arguments: dict) -> str:
        properties = self.parameters.get("properties", {})
        if error.validator == "required" and not error.path:
            missing = [name for name in error.validator_value if name not in arguments]
            return f"{self.name}: argument {missing[0]!r} is required"
        if error.validator == "additionalProperties" and not error.path:
            extra = sorted(set(arguments) - set(properties))
            expected = ", ".join(properties) or "none"
            return f"{self.name}: unexpected argument {extra[0]!r} (expected: {expected})"
        where = "".join(f"[{p!r}]" for p in list(error.path)[1:])
        return f"{self.name}: argument {error.path[0]!r}{where}: {error.message}"


def _depth(error: ValidationError) -> int:
    return len(error.path)  # report the outermost problem first: a missing argument before a type


@typing.overload
def tool(fn: Callable[..., Any]) -> Tool: ...
@typing.overload
def tool(
    *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: `@tool` or `@tool(name=..., description=...)` turns a typed function into a Tool.

    The docstring's first paragraph becomes the description and its Google-style "Args:" section
    the per-argument descriptions; type hints become the JSON Schema.
    """
    if fn is None:
        return functools.partial(tool, name=name, description=description)
    return _build(fn, name or fn.__name__, description)


def _build(fn: Callable[..., Any], name: str, description: str | None) -> Tool:
    doc = inspect.cleandoc(fn.__doc__ or "")
    arg_docs = _arg_docs(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    none_defaults: list[str] = []  # `x: int | None` without a default: absent means None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *{param.name} cannot be described to a model")
        if param.name not in hints:
            raise TypeError(f"tool {name!r}: parameter {param.name!r} needs a type hint")
        schema, optional = _schema(hints[param.name], f"tool {name!r}, parameter {param.name!r}")
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is param.empty and not optional:
            required.append(param.name)
        elif param.default is param.empty:
            none_defaults.append(param.name)
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,  # an unexpected argument gets a clear error, not a crash
    }
    summary = description if description is not None else doc.split("\n\n")[0].replace("\n", " ")
    call = fn
    if none_defaults:

        @functools.wraps(fn)
        def call(**kwargs: Any) -> Any:
            return fn(**(dict.fromkeys(none_defaults) | kwargs))

    return Tool(name=name, description=summary, parameters=parameters, fn=call)


def _schema(hint: Any, where: str) -> tuple[dict, bool]:
    """JSON Schema for a type hint, and whether None is allowed (which makes it optional)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        schemas = [_schema(a, where)[0] for a in rest]
        return (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), len(rest) < len(args)
    if origin is Literal:
        kinds = {type(a) for a in args}
        schema = {"type": _JSON_TYPES[kinds.pop()]} if len(kinds) == 1 else {}
        return schema | {"enum": list(args)}, False
    if hint is list or origin is list:
        return (
            {"type": "array", "items": _schema(args[0], where)[0]} if args else {"type": "array"}
        ), False
    if hint is dict or origin is dict:
        return {"type": "object"}, False
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}, False
    raise TypeError(
        f"{where}: type {hint!r} has no JSON Schema equivalent; use str, int, float, "
        "bool, list[...], dict, Literal[...] or X | None"
    )


def _arg_docs(doc: str) -> dict[str, str]:
    """Descriptions from a Google-style "Args:" section: `name (type): text`, continued indented."""
    docs: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:"))
    except StopIteration:
        return docs
    indent, current = None, None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section ("Returns:", ...)
        indent = depth if indent is None else indent
        match = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if depth == indent and match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current is not None:
            docs[current] = f"{docs[current]} {line.strip()}".strip()
    return docs
