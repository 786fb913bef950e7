"""Tool calling on BFCL (simple, multiple, parallel, irrelevance), with and without the grammar.

    .venv/bin/python benchmarks/tools.py [--model smollm2-135m] [--limit 30] [--threads 1]
        [--constrained both|on|off] [--categories simple,multiple,parallel,irrelevance]
        [--frequency-penalty 0.5] [--ids simple_python_37,...]

Per category and mode: n; valid calls (every call parses, names a given function and its arguments
match the schema; for irrelevance: no call at all); AST accuracy from bfcl-eval's own checker; and
replies cut off at max_tokens. Greedy decoding with a frequency penalty (0.5 by default, the same
in both modes): without one, SmolLM2 loops inside some arguments ("Santa Barbara", "Santa Barbara",
...) until max_tokens, a valid prefix of a call that never ends (30 of 400 simple). --limit 0 runs all 1040 entries, hours on 2 CPU
cores, so the default is the first 30 of each category (~20 min). On a machine shared with other
work, --threads 1 avoids OpenMP oversubscription (40x slower here). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import jsonschema
import torch
from common import commit, peak_rss_mib, save
from rich.console import Console
from rich.table import Table

from pellucid import LLM, SamplingParams
from pellucid.structured import parse_tool_calls, prepare_chat


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
        Category("irrelevance", "irrelevance", "auto", True, 256),
    ]
}
DEFAULT_LIMIT = 30  # entries per category: ~20 min on 2 cores; 0 runs all 1040
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
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {CHECKER_MODEL: types.SimpleNamespace(underscore_to_dot=False)}
    sys.modules["bfcl_eval.constants.model_config"] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language.PYTHON


def load(category: Category, limit: int, ids: set[str]) -> list[dict]:
    """BFCL entries (JSON lines), each with its ground truth under "answer" where there is one."""
    data = Path(importlib.util.find_spec("bfcl_eval").origin).parent / "data"
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


def call_error(text: str, schemas: dict[str, dict]) -> str:
    """Why the reply is not only valid calls ('' when it is)."""
    reply = parse_tool_calls(text)
    if reply.errors:
        return reply.errors[0]
    if not reply.tool_calls:
        return "no call"
    for call in reply.tool_calls:
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
    text: str,
    category: Category,
    names: dict[str, str],
    checker: Checker,
    language: object,
) -> tuple[bool, str]:
    """(correct, error type) by BFCL's rules; irrelevance is correct when no call decodes."""
    calls = parse_tool_calls(text).tool_calls
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


def run_mode(
    llm: LLM,
    category: Category,
    entries: list[dict],
    constrained: bool,
    checker: Checker,
    language: object,
    frequency_penalty: float,
) -> dict:
    start = time.perf_counter()
    requests, compile_errors, prepared = [], {}, []
    for e in entries:
        tools, names, schemas = openai_tools(e)
        chat = prepare_chat(
            llm.tokenizer,
            e["question"][0],
            tools=tools,
            tool_choice=category.tool_choice,
            parallel_tool_calls=category.parallel,
            constrained=constrained,
        )
        ids = llm.tokenizer.encode(chat.prompt, parse_special=True)
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
        requests.append((ids, params))
        prepared.append((e, names, schemas))
    # All at once, each with its own grammar, so the engine batches them.
    outs = llm.generate([ids for ids, _ in requests], [params for _, params in requests])
    elapsed = time.perf_counter() - start

    valid = correct = cut = 0
    examples, invalid_ids, ast_errors, invalid = [], [], Counter(), Counter()
    for (e, names, schemas), out in zip(prepared, outs):
        cut += out.finish_reason == "length"
        if category.tool_choice == "auto":
            why = "" if "<tool_call>" not in out.text else "made a call"
        else:
            why = call_error(out.text, schemas)
        valid += not why
        ok, error_type = ast_verdict(e, out.text, category, names, checker, language)
        correct += ok
        ast_errors["ok" if ok else error_type] += 1
        if why:
            reason = reason_of(why, out.finish_reason)
            invalid[reason] += 1
            invalid_ids.append(e["id"])
            if invalid[reason] <= EXAMPLES:
                examples.append({"id": e["id"], "why": why[:300], "text": clip(out.text)})
    examples += [{"id": i, "why": err[:300]} for i, err in compile_errors.items()]
    invalid_ids += list(compile_errors)
    if compile_errors:
        invalid["grammar does not compile"] = len(compile_errors)
    n = len(entries)
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "category": category.name,
        "constrained": constrained,
        "n": n,
        "valid": valid,
        "valid_rate": round(valid / n, 4),
        "ast_correct": correct,
        "ast_accuracy": round(correct / n, 4),
        "hit_max_tokens": cut,
        "grammar_compile_errors": len(compile_errors),
        "generated_tokens": tokens,
        "seconds": round(elapsed, 1),
        "tok_s": round(tokens / elapsed, 1),
        "ast_error_types": dict(ast_errors.most_common()),
        "invalid_reasons": dict(invalid.most_common()),
        "invalid_ids": invalid_ids,
        "invalid_examples": examples,
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


def pellucid_changes() -> list[str]:
    """Files under pellucid/ that differ from HEAD: others edit this tree while a run goes on."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", "pellucid"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent,
    )
    return [line[3:] for line in out.stdout.splitlines()]


def print_table(rows: list[dict]) -> None:
    table = Table(title="BFCL tool calling (valid: no-call rate for irrelevance)")
    for col in ("category", "grammar", "n", "valid", "AST acc", "hit max_tokens", "s", "tok/s"):
        table.add_column(col, justify="left" if col in ("category", "grammar") else "right")
    for r in rows:
        table.add_row(
            r["category"],
            "on" if r["constrained"] else "off",
            str(r["n"]),
            f"{r['valid_rate']:.1%}",
            f"{r['ast_accuracy']:.1%}",
            str(r["hit_max_tokens"]),
            f"{r['seconds']:.0f}",
            f"{r['tok_s']:.1f}",
        )
    Console().print(table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="per category; 0 = all")
    ap.add_argument("--constrained", choices=("both", "on", "off"), default="both")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--frequency-penalty", type=float, default=0.5)
    ap.add_argument("--ids", default="", help="only these entry ids (comma-separated)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    categories = [CATEGORIES[c.strip()] for c in args.categories.split(",")]
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.constrained]

    code = {"commit_at_start": commit(), "pellucid_changes_at_start": pellucid_changes()}
    checker, language = load_checker()
    llm = LLM(args.model, dtype="float32")
    rows = []
    for category in categories:
        entries = load(category, args.limit, set(filter(None, args.ids.split(","))))
        for constrained in modes:
            rows.append(
                run_mode(
                    llm, category, entries, constrained, checker, language, args.frequency_penalty
                )
            )
            r = rows[-1]
            print(
                f"{category.name:12s} grammar {'on ' if constrained else 'off'} n {r['n']:4d}  "
                f"valid {r['valid_rate']:6.1%}  AST {r['ast_accuracy']:6.1%}  "
                f"hit max_tokens {r['hit_max_tokens']:3d}  {r['seconds']:.0f} s",
                flush=True,
            )
    print_table(rows)
    default = (
        args.categories == ",".join(CATEGORIES) and args.limit == DEFAULT_LIMIT and not args.ids
    )
    size = "ids" if args.ids else args.limit or "all"
    tag = "" if default else f"-{'-'.join(c.name for c in categories)}-n{size}"
    if args.constrained != "both":
        tag += f"-grammar-{args.constrained}"
    save(
        f"tools{tag}",
        {
            "model": Path(args.model).stem if Path(args.model).exists() else args.model,
            "versions": {p: version(p) for p in ("bfcl-eval", "llguidance", "jsonschema")},
            **code,
            "limit": args.limit,
            "ids": args.ids,
            "frequency_penalty": args.frequency_penalty,
            "results": rows,
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "workload": f"BFCL v4 entries in file order; greedy, frequency_penalty "
            f"{args.frequency_penalty}; tool_choice required (auto for irrelevance); "
            "max_tokens 256 (512 for parallel)",
        },
    )


if __name__ == "__main__":
    main()
