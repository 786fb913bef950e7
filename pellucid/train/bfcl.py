"""Tool calling on BFCL v4 (`pellucid eval --task bfcl:simple`, benchmarks/tools.py): the
categories, entries as OpenAI tools, the replies from Python, and the scoring.

The entries and the checker come from the `bfcl-eval` package (data and code; installed with
`--no-deps`, as `make setup` does, since its own dependencies are every vendor's SDK). Valid
replies (at least one call, every call names a given function and its arguments match the
schema; for irrelevance: no call at all), AST accuracy from bfcl-eval's own checker, duplicate
calls, replies that ended at max_tokens and the calls those still returned.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema

from pellucid.engine import RequestOutput, SamplingParams
from pellucid.errors import PellucidError
from pellucid.llm import LLM
from pellucid.structured import ToolCall, parse_tool_calls, prepare_chat


@dataclass(frozen=True, slots=True)
class Category:
    name: str
    file: str  # BFCL_v4_<file>.json; also the test_category the checker reads
    tool_choice: str
    parallel: bool
    max_tokens: int  # a valid call is far shorter: cut-offs are the model rambling


CATEGORIES = {
    c.name: c
    for c in [
        Category("simple", "simple_python", "required", False, 256),
        Category("multiple", "multiple", "required", False, 256),
        Category("parallel", "parallel", "required", True, 512),
        Category("parallel_multiple", "parallel_multiple", "required", True, 512),
        Category("irrelevance", "irrelevance", "auto", True, 256),
    ]
}
PREFIX = "bfcl:"  # `pellucid eval --task bfcl:CATEGORY`
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23"  # as make setup does
EXAMPLES = 8  # invalid replies kept per reason, to show what went wrong
CHECKER_MODEL = "pellucid"  # the checker looks this up in our stand-in MODEL_CONFIG_MAPPING
Checker = Callable[..., dict]


def load_checker() -> tuple[Checker, object]:
    """bfcl-eval's ast_checker and its Language.PYTHON, imported without the vendor SDKs.

    bfcl_eval.constants.model_config imports every API handler (anthropic, openai, ...), which a
    --no-deps install leaves out; the checker reads one thing from it,
    MODEL_CONFIG_MAPPING[model].underscore_to_dot. We hand back dotted names ourselves, so a
    stand-in module with that one entry replaces it.
    """
    if importlib.util.find_spec("bfcl_eval") is None:
        raise BfclError(f"BFCL's checker comes from the bfcl-eval package: {INSTALL}")
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {CHECKER_MODEL: types.SimpleNamespace(underscore_to_dot=False)}
    sys.modules["bfcl_eval.constants.model_config"] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language.PYTHON


class BfclError(PellucidError):
    """BFCL cannot run: an unknown category, or bfcl-eval is not installed."""


def category(name: str) -> Category:
    if name not in CATEGORIES:
        raise BfclError(f"no BFCL category {name!r}: one of {', '.join(CATEGORIES)}")
    return CATEGORIES[name]


def load(category: Category, limit: int | None = None, ids: set[str] | None = None) -> list[dict]:
    """BFCL entries (JSON lines), each with its ground truth under "answer" where there is one;
    the first `limit` (None or 0: all)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or spec.origin is None:
        raise BfclError(f"BFCL's entries come from the bfcl-eval package: {INSTALL}")
    data = Path(spec.origin).parent / "data"
    name = f"BFCL_v4_{category.file}.json"
    entries = [json.loads(line) for line in (data / name).read_text().splitlines() if line]
    answers = data / "possible_answer" / name
    if answers.exists():
        lines = answers.read_text().splitlines()
        truth = {a["id"]: a["ground_truth"] for a in map(json.loads, lines)}
        for e in entries:
            e["answer"] = truth[e["id"]]
    if ids:
        entries = [e for e in entries if e["id"] in ids]
    return entries[:limit] if limit else entries


def json_schema(bfcl: dict) -> dict:
    """BFCL's parameter types -> JSON Schema: dict -> object, float -> number, tuple -> array,
    any -> no type constraint; recursively through properties and items."""
    out = dict(bfcl)
    kind = out.pop("type", None)
    if kind not in (None, "any"):
        out["type"] = {"dict": "object", "float": "number", "tuple": "array"}.get(kind, kind)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: json_schema(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = json_schema(out["items"])
    return out


def openai_tools(entry: dict) -> tuple[list[dict], dict[str, str], dict[str, dict]]:
    """Tools as OpenAI sends them (no dots in names, as BFCL's OpenAI handlers do), the map back
    to BFCL's names, and each tool's parameter schema by the name the model sees."""
    tools, names, schemas = [], {}, {}
    for f in entry["function"]:
        name = f["name"].replace(".", "_")
        names[name], schemas[name] = f["name"], json_schema(f["parameters"])
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f.get("description", ""),
                    "parameters": schemas[name],
                },
            }
        )
    return tools, names, schemas


@dataclass(slots=True)
class Reply:
    """One reply, as the client gets it."""

    calls: list[ToolCall]
    errors: list[str]  # <tool_call> blocks that were not valid calls
    finish_reason: str
    tokens: int
    text: str  # the reply's text, or its calls as JSON lines: for the examples
    duplicates: int  # calls equal in name and arguments to an earlier one of the reply


def python_reply(out: RequestOutput) -> Reply:
    """From the engine's text; duplicates are counted among the blocks the engine let through,
    before parse_tool_calls drops any."""
    parsed = parse_tool_calls(out.text)
    blocks = [
        _key(b) for b in re.findall(r"<tool_call>\n?(.*?)\n?</tool_call>", out.text, re.DOTALL)
    ]
    return Reply(
        parsed.tool_calls,
        parsed.errors,
        out.finish_reason or "",
        len(out.token_ids),
        out.text,
        duplicate_count([b for b in blocks if b is not None]),
    )


def _key(block: str) -> tuple[str, str] | None:
    try:
        call = json.loads(block)
        return call["name"], json.dumps(call["arguments"], sort_keys=True)
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def python_route(
    llm: LLM,
    category: Category,
    entries: list[dict],
    constrained: bool = True,
    frequency_penalty: float = 0.5,
    batch: int = 0,
    advance: Callable[[int], None] | None = None,
) -> tuple[dict[str, Reply], dict[str, str], float]:
    """Replies by entry id, grammars llguidance refused by entry id, seconds. Greedy, with a
    frequency penalty (without one SmolLM2 loops inside some arguments); `batch` requests
    submitted together (0: all), `advance(n)` called as each batch ends."""
    start = time.perf_counter()
    requests, compile_errors, ids_of = [], {}, []
    for e in entries:
        tools, _, _ = openai_tools(e)
        chat = prepare_chat(
            llm.tokenizer,
            e["question"][0],
            tools=tools,
            tool_choice=category.tool_choice,
            parallel_tool_calls=category.parallel,
            constrained=constrained,
        )
        params = SamplingParams(
            temperature=0,
            max_tokens=category.max_tokens,
            frequency_penalty=frequency_penalty,
            **chat.sampling_fields(),
        )
        if chat.grammar is not None:
            try:  # compile now, so a grammar llguidance rejects is reported, not fatal
                llm.engine.grammars.matcher(chat.grammar)
            except ValueError as err:
                compile_errors[e["id"]] = str(err)
                continue
        requests.append((llm.encode_chat(chat.prompt), params))
        ids_of.append(e["id"])
    replies: dict[str, Reply] = {}
    size = batch or max(len(requests), 1)
    for at in range(0, len(requests), size):  # each with its own grammar, batched
        part = requests[at : at + size]
        outs = llm.generate([ids for ids, _ in part], [params for _, params in part])
        replies |= {i: python_reply(out) for i, out in zip(ids_of[at : at + size], outs)}
        if advance is not None:
            advance(len(part))
    return replies, compile_errors, time.perf_counter() - start


def duplicate_count(keys: list[tuple[str, str]]) -> int:
    return len(keys) - len(set(keys))


def call_error(reply: Reply, schemas: dict[str, dict]) -> str:
    """Why the reply is not only valid calls ('' when it is)."""
    if reply.errors:
        return reply.errors[0]
    if not reply.calls:
        return "no call"
    for call in reply.calls:
        if call.name not in schemas:
            return f"unknown function {call.name!r}"
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schemas[call.name]).iter_errors(call.args)
        )
        if error is not None:
            return f"{call.name}: {error.message}"
    return ""


def ast_verdict(
    entry: dict,
    calls: list[ToolCall],
    category: Category,
    names: dict[str, str],
    checker: Checker,
    language: object,
) -> tuple[bool, str]:
    """(correct, error type) by BFCL's rules; irrelevance is correct when no call decodes."""
    if category.tool_choice == "auto":
        return not calls, "" if not calls else "irrelevance_error:decoder_success"
    output = [{names.get(c.name, c.name): c.args} for c in calls]
    try:
        result = checker(
            entry["function"], output, entry["answer"], language, category.file, CHECKER_MODEL
        )
    except Exception as e:  # noqa: BLE001 - third-party code on any output: a crash is a miss
        return False, f"checker_crash:{type(e).__name__}"
    return result["valid"], result.get("error_type", "")


def score(
    category: Category,
    entries: list[dict],
    replies: dict[str, Reply],
    refused: dict[str, str],
    seconds: float,
    checker: Checker,
    language: object,
) -> dict:
    """One category's figures; under "replies", every reply with its verdicts."""
    valid = correct = cut = cut_calls = duplicates = 0
    examples, invalid_ids, ast_errors, invalid = [], [], Counter(), Counter()
    records = []  # every reply with its verdicts: main writes them out with --replies
    for e in entries:
        reply = replies.get(e["id"])
        if reply is None:
            continue
        _, names, schemas = openai_tools(e)
        cut += reply.finish_reason == "length"
        cut_calls += len(reply.calls) if reply.finish_reason == "length" else 0
        duplicates += reply.duplicates
        if category.tool_choice == "auto":
            why = "made a call" if reply.calls or reply.errors else ""
        else:
            why = call_error(reply, schemas)
        valid += not why
        ok, error_type = ast_verdict(e, reply.calls, category, names, checker, language)
        correct += ok
        ast_errors["ok" if ok else error_type] += 1
        records.append(
            {
                "id": e["id"],
                "question": e["question"][0][-1]["content"],
                "calls": [{"name": c.name, "arguments": c.args} for c in reply.calls],
                "finish_reason": reply.finish_reason,
                "tokens": reply.tokens,
                "invalid": why,
                "ast": "ok" if ok else error_type,
            }
        )
        if why:
            reason = reason_of(why, reply.finish_reason)
            invalid[reason] += 1
            invalid_ids.append(e["id"])
            if invalid[reason] <= EXAMPLES:
                examples.append({"id": e["id"], "why": why[:300], "text": clip(reply.text)})
    examples += [{"id": i, "why": err[:300]} for i, err in refused.items()]
    invalid_ids += list(refused)
    if refused:
        invalid["refused (grammar does not compile)"] = len(refused)
    n = len(entries)
    tokens = sum(r.tokens for r in replies.values())
    return {
        "category": category.name,
        "n": n,
        "valid": valid,
        "valid_rate": round(valid / n, 4),
        "ast_correct": correct,
        "ast_accuracy": round(correct / n, 4),
        "duplicate_calls": duplicates,
        "hit_max_tokens": cut,
        "calls_in_replies_cut_at_max_tokens": cut_calls,
        "refused": len(refused),
        "generated_tokens": tokens,
        "seconds": round(seconds, 1),
        "tok_s": round(tokens / seconds, 1),
        "ast_error_types": dict(ast_errors.most_common()),
        "invalid_reasons": dict(invalid.most_common()),
        "invalid_ids": invalid_ids,
        "invalid_examples": examples,
        "replies": records,
    }


def reason_of(why: str, finish_reason: str | None) -> str:
    """A reply's invalidity, coarsely: the table of reasons stays short."""
    if finish_reason == "length":
        return "cut off at max_tokens"
    kinds = (
        "no call",
        "made a call",
        "unknown function",
        "not valid JSON",
        "no string 'name'",
        "not a JSON object",
        "not closed",
    )
    return next((k for k in kinds if k in why), "arguments do not match the schema")


def clip(text: str, keep: int = 200) -> str:
    """Both ends of a long reply: how it began and where it was going when cut off."""
    return text if len(text) <= 2 * keep else f"{text[:keep]} [...] {text[-keep:]}"
