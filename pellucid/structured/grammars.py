"""Grammars (llguidance's Lark dialect) that make tool calls and JSON replies valid by construction.

tool_choice "required" or a named function: the reply *is* one call (or several, in parallel).
tool_choice "auto": free text, but from the moment the model writes `<tool_call>` the rest must be
a call to one of the tools with arguments matching its schema (a lazy trigger, as llama.cpp does).
response_format: the reply is a JSON object, or one matching the given schema.
"""

from __future__ import annotations

import json
from typing import Any

from pellucid.structured.tool_calls import CALL_CLOSE, CALL_OPEN

# One spelling of JSON: no free whitespace for a small model to loop on, the separators models
# see in their training data.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CALL = f'"{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"'
# Parallel calls per reply, at most. A small model, free to add calls, repeats its last one until
# max_tokens (BFCL parallel: 23 of 30 replies); BFCL's parallel entries need 2-4.
MAX_PARALLEL_CALLS = 8


def tool_call_grammar(
    tools: list[dict], tool_choice: str | dict = "required", parallel: bool = True
) -> str | None:
    """The grammar for a reply under tool_choice; None when nothing is constrained ("none")."""
    choice = tool_choice_name(tools, tool_choice)
    if choice == "none":
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if function_of(t)["name"] == choice]
    more = f' ("\\n" {_CALL}){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    if choice == "auto":
        start = (
            f'start: free_text | call_open "\\n" body "\\n{CALL_CLOSE}"{more}\n'
            f'call_open[lazy]: TEXT "{CALL_OPEN}"\n'
            "free_text: TEXT\n"
            "TEXT: /(.|\\n)*/\n"
        )
    else:
        # The newline that would lead into another call may also end the reply, so the close
        # margin can stop there rather than open a call it would have to cut short.
        start = f'start: {_CALL}{more} "\\n"?\n'
    return f"%llguidance {{}}\n{start}body: %json {json.dumps(call_schema(tools))}\n"


def call_schema(tools: list[dict]) -> dict:
    """JSON schema of one call: {"name": <one tool>, "arguments": <that tool's parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": strict(f.get("parameters") or {"type": "object", "properties": {}}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in map(function_of, tools)
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_STYLE}


def strict(schema: Any) -> Any:
    """A copy of a schema whose objects allow no properties beyond those listed, unless it says
    otherwise (OpenAI's strict mode). JSON Schema allows extra keys by default, and a small model
    given that freedom invents them ("x_value_1", "x_value_2", ...) until it runs out of tokens."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
    if "properties" in out and "additionalProperties" not in out:  # a free-form dict stays free
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties", "not"}


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "start: %json " + json.dumps({"type": "object", "x-guidance": JSON_STYLE})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
            )
        schema = spec.get("schema") or {"type": "object"}
        return "start: %json " + json.dumps({**schema, "x-guidance": JSON_STYLE})
    raise ValueError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def tool_choice_name(tools: list[dict], tool_choice: str | dict) -> str:
    """'none' | 'auto' | 'required' | the one function's name; checks it against the tools."""
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        known = [function_of(t)["name"] for t in tools]
        if name not in known:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not among the "
                f"tools ({', '.join(known) or 'none given'})"
            )
        return name
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice is 'required' but no tools were given")
    return tool_choice if tools else "none"


def function_of(tool: dict) -> dict:
    """The {"name", "description", "parameters"} part of an OpenAI tools entry, checked."""
    f = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(
            f"each tool must be {{'type': 'function', 'function': {{'name': ..., "
            f"'parameters': {{...}}}}}}, got {tool!r:.200}"
        )
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"parameters of tool {f['name']!r} must be a JSON schema object")
    return f
