"""Tool calling on BFCL v4 (simple, multiple, parallel, parallel_multiple, irrelevance), two ways.

    .venv/bin/python benchmarks/tools.py [--model smollm2-135m] [--limit 30] [--threads 1]
        [--via python,server] [--constrained both|on|off] [--frequency-penalty 0.5]
        [--server-dtype int4] [--python-dtype float32] [--replies FILE]
        [--categories simple,multiple,parallel,parallel_multiple,irrelevance] [--ids ...]

python: LLM.generate from Python (float32, or --python-dtype) with the settings that suit a small
model: greedy, a frequency penalty (0.5 by default; without one SmolLM2 loops inside some
arguments, "Santa Barbara", "Santa Barbara", ...), parallel_tool_calls only where the category
wants several calls, and max_tokens 256 (512 for the parallel ones); with and without the grammar.
server: `pellucid serve` driven by the official `openai` client the way its users send requests:
model, messages, tools and tool_choice and nothing else, so temperature, top_p, max_tokens and
parallel_tool_calls are the server's defaults (greedy for a reply that must call, the model's
recommended sampling otherwise, up to the end of the context, parallel calls where the model's
chat template writes them: not SmolLM2's, so one call a reply, as llama.cpp's server decides); 16
requests in flight. The grammar is always on there. Irrelevance alone also sends max_tokens
4096, as BFCL's own harness does for local models (min(4096, context - prompt)): a quarter of
SmolLM2's free-text replies there loop to the end of the 8k context, and rows that long make
steps of a few hundred ms.

tool_choice is "required" except for irrelevance ("auto"). Per category and route: valid replies,
AST accuracy, duplicate calls, replies cut at max_tokens (bfcl.py says how each is counted).
--limit 0 runs every entry (hours), so the default is the first 30 of each category. --replies
FILE writes every reply with its verdict as JSON lines, to read what went wrong. --threads 1 avoids OpenMP oversubscription on a
machine shared with other work. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import openai
import torch
from common import commit, peak_rss_mib, save
from openai.types.chat import ChatCompletion
from rich.console import Console
from rich.table import Table
from serve import pellucid_server

from pellucid import LLM
from pellucid.structured import ToolCall
from pellucid.train.bfcl import (
    CATEGORIES,
    Category,
    Reply,
    duplicate_count,
    load,
    load_checker,
    openai_tools,
    python_route,
    score,
)

DEFAULT_LIMIT = 30  # entries per category; 0 runs them all (1,240)
IN_FLIGHT = 16  # server route: requests sent at once, so the engine batches them
BFCL_LOCAL_MAX_TOKENS = 4096


def server_reply(response: ChatCompletion) -> Reply:
    """From the server's `tool_calls`, which is what a client runs."""
    choice = response.choices[0]
    calls = [
        ToolCall(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
    ]
    content = choice.message.content or ""
    errors = ["a <tool_call> block came back as text"] if "<tool_call>" in content else []
    text = content + "".join(f"\n{c.name} {c.arguments}" for c in calls)
    tokens = response.usage.completion_tokens
    return Reply(
        calls, errors, choice.finish_reason, tokens, text, duplicate_count([c.key for c in calls])
    )


async def server_route(
    url: str, model: str, category: Category, entries: list[dict]
) -> tuple[dict[str, Reply], dict[str, str], float]:
    """The same, through the server; a request it refuses (HTTP 400) counts as refused."""
    start = time.perf_counter()
    # No client timeout short of an hour: a reply that loops runs to the end of the context.
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(IN_FLIGHT)
    # BFCL's harness for local models (base_oss_handler) caps a reply at 4096 tokens
    limit = {"max_tokens": BFCL_LOCAL_MAX_TOKENS} if category.tool_choice == "auto" else {}

    async def one(e: dict) -> Reply | str:
        tools, _, _ = openai_tools(e)
        async with gate:
            try:
                return server_reply(
                    await client.chat.completions.create(
                        model=model,
                        messages=e["question"][0],
                        tools=tools,
                        tool_choice=category.tool_choice,
                        **limit,
                    )
                )
            except openai.BadRequestError as err:
                return str(err)

    async with client:  # closed inside this event loop, which asyncio.run then ends
        results = await asyncio.gather(*map(one, entries))
    replies = {e["id"]: r for e, r in zip(entries, results) if isinstance(r, Reply)}
    refused = {e["id"]: r for e, r in zip(entries, results) if isinstance(r, str)}
    return replies, refused, time.perf_counter() - start


def pellucid_changes() -> list[str]:
    """Files under pellucid/ that differ from HEAD: others edit this tree while a run goes on."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", "pellucid"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[1],  # the repository: "pellucid" is its folder
    )
    return [line[3:] for line in out.stdout.splitlines()]


def print_table(rows: list[dict]) -> None:
    table = Table(title="BFCL tool calling (valid: no-call rate for irrelevance)")
    columns = ("category", "route", "grammar", "n", "valid", "AST acc", "dup calls", "cut", "s")
    for col in columns:
        table.add_column(col, justify="left" if col in columns[:3] else "right")
    for r in rows:
        table.add_row(
            r["category"],
            r["route"],
            "on" if r["constrained"] else "off",
            str(r["n"]),
            f"{r['valid_rate']:.1%}",
            f"{r['ast_accuracy']:.1%}",
            str(r["duplicate_calls"]),
            str(r["hit_max_tokens"]),
            f"{r['seconds']:.0f}",
        )
    Console().print(table)


def report(row: dict) -> None:
    print(
        f"{row['category']:17s} {row['route']:6s} grammar {'on ' if row['constrained'] else 'off'} "
        f"n {row['n']:4d}  valid {row['valid_rate']:6.1%}  AST {row['ast_accuracy']:6.1%}  "
        f"dup calls {row['duplicate_calls']:3d}  hit max_tokens {row['hit_max_tokens']:3d}  "
        f"{row['seconds']:.0f} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="per category; 0 = all")
    ap.add_argument("--via", default="server,python", help="server, python or both")
    ap.add_argument("--server-dtype", default="int4", help="the server's --dtype (its default)")
    ap.add_argument(
        "--python-dtype", default="float32", help="LLM's dtype (float32: the reference figures)"
    )
    ap.add_argument("--constrained", choices=("both", "on", "off"), default="both")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--frequency-penalty", type=float, default=0.5)
    ap.add_argument("--ids", default="", help="only these entry ids (comma-separated)")
    ap.add_argument("--replies", type=Path, help="write every reply here (JSON lines)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    categories = [CATEGORIES[c.strip()] for c in args.categories.split(",")]
    entries = {
        c.name: load(c, args.limit, set(filter(None, args.ids.split(",")))) for c in categories
    }
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.constrained]
    routes = [r.strip() for r in args.via.split(",")]

    code = {"commit_at_start": commit(), "pellucid_changes_at_start": pellucid_changes()}
    checker, language = load_checker()
    rows = []
    if "server" in routes:
        with pellucid_server(args.model, args.server_dtype, []) as (url, _):
            for c in categories:
                replies, refused, seconds = asyncio.run(
                    server_route(url, args.model, c, entries[c.name])
                )
                row = score(c, entries[c.name], replies, refused, seconds, checker, language)
                rows.append({"route": "server", "constrained": True, **row})
                report(rows[-1])
    if "python" in routes:
        llm = LLM(args.model, dtype=args.python_dtype)
        for c in categories:
            for constrained in modes:
                replies, refused, seconds = python_route(
                    llm, c, entries[c.name], constrained, args.frequency_penalty
                )
                row = score(c, entries[c.name], replies, refused, seconds, checker, language)
                rows.append({"route": "python", "constrained": constrained, **row})
                report(rows[-1])
    print_table(rows)
    records = [
        {"route": r["route"], "grammar": r["constrained"], "category": r["category"], **reply}
        for r in rows
        for reply in r.pop("replies")
    ]
    if args.replies:
        args.replies.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    default = (
        args.categories == ",".join(CATEGORIES) and args.limit == DEFAULT_LIMIT and not args.ids
    )
    size = "ids" if args.ids else args.limit or "all"
    tag = "" if default else f"-{'-'.join(c.name for c in categories)}-n{size}"
    if routes != ["server", "python"]:
        tag += f"-via-{'-'.join(routes)}"
    if "server" in routes and args.server_dtype != "int4":
        tag += f"-{args.server_dtype}"
    if args.constrained != "both":
        tag += f"-grammar-{args.constrained}"
    if "python" in routes and args.python_dtype != "float32":
        tag += f"-python-{args.python_dtype}"
    if args.frequency_penalty != 0.5:
        tag += f"-fp{args.frequency_penalty:g}"
    save(
        f"tools{tag}",
        {
            "model": Path(args.model).stem if Path(args.model).exists() else args.model,
            "versions": {
                p: version(p) for p in ("bfcl-eval", "llguidance", "jsonschema", "openai")
            },
            **code,
            "limit": args.limit,
            "ids": args.ids,
            "frequency_penalty": args.frequency_penalty,
            "server_dtype": args.server_dtype,
            "python_dtype": args.python_dtype,
            "results": rows,
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "workload": "BFCL v4 entries in file order; tool_choice required (auto for "
            f"irrelevance). python: {args.python_dtype}, greedy, frequency_penalty "
            f"{args.frequency_penalty}, max_tokens 256 (512 for the parallel ones). server: "
            f"--dtype {args.server_dtype}, the openai client's defaults (model, messages, tools, "
            f"tool_choice only), {IN_FLIGHT} requests in flight",
        },
    )


if __name__ == "__main__":
    main()
