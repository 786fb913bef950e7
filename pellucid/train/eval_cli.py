"""`pellucid eval`: bits per byte, multiple-choice and generation tasks and BFCL tool calls, for
one model and the ones it is compared with (loaded one at a time), as a table, a JSON file or a
report card (train/evaluate.py measures, train/report.py draws the card).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any


def run_eval(args: argparse.Namespace) -> int:
    from pellucid.llm import LLM
    from pellucid.train import evaluate as ev
    from pellucid.train import report

    for task in args.task:  # a malformed file or unknown task fails before the model loads
        if task.startswith(ev.bfcl.PREFIX):
            ev.bfcl.category(task.removeprefix(ev.bfcl.PREFIX))
            continue
        path = ev.task_path(task)
        if ev.is_generation(path):
            ev.read_generation_task(path)
        else:
            ev.read_task(path)
    compare = args.compare
    if compare is None:
        compare = ["smollm2-135m", "gemma3-270m"] if args.report else []
    cards, results = [], []
    for name in [args.model, *compare]:  # one model loaded at a time
        llm = LLM(name, dtype=args.dtype)
        mine = _evaluate(llm, args)
        _print_table(f"pellucid eval: {llm.path.name} ({args.dtype})", mine)
        results.append(mine)
        if args.report:
            cards.append(report.card(llm.path.name, llm, mine))
        del llm
    if args.json:
        out = ev.report(results[0])
        out["compare"] = {name: ev.report(r)["results"] for name, r in zip(compare, results[1:])}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"wrote {report.write_report(args.report, cards, args.training_run)}", file=sys.stderr
        )
    return 0


def _evaluate(llm: Any, args: argparse.Namespace) -> list:
    """Every measure `args` asks for, of one model, under a progress bar."""
    from rich.progress import Progress

    from pellucid.train import evaluate as ev

    sources = ["shakespeare", "kjv"] if args.bpb is None else args.bpb
    results: list = []
    with Progress(transient=True) as progress:
        for source in sources:
            total = len(ev.text_windows(llm, source, args.max_bytes))
            bar = progress.add_task(f"bits per byte: {source}", total=total)
            advance = functools.partial(progress.advance, bar)
            results.append(ev.bits_per_byte(llm, source, args.max_bytes, advance=advance))
        for task in args.task:
            bar = progress.add_task(task, total=ev.task_size(llm, task, args.limit))
            advance = functools.partial(progress.advance, bar)
            if task.startswith(ev.bfcl.PREFIX):
                results.append(ev.tool_calling(llm, task, args.limit, advance))
            elif ev.is_generation(ev.task_path(task)):
                results.append(
                    ev.generation(llm, task, args.limit, advance, args.chat, args.max_tokens)
                )
            else:
                results.append(ev.multiple_choice(llm, task, args.limit, advance))
    return results


def _print_table(title: str, results: list) -> None:
    from rich.console import Console
    from rich.table import Table

    from pellucid.train import evaluate as ev

    table = Table(title=title)
    for column in ("what", "on", "score", "over"):
        table.add_column(column)
    for r in results:
        if isinstance(r, ev.BitsPerByte):
            table.add_row("bits per byte", r.source, f"{r.bits_per_byte:.4f}", f"{r.bytes:,} bytes")
        elif isinstance(r, ev.Generation):
            table.add_row(
                "exact / contains / stopped" + (" (chat)" if r.chat else ""),
                r.task,
                f"{r.exact_match:.3f} / {r.contains:.3f} / {r.stopped:.3f}",
                f"{r.questions} prompts",
            )
        elif isinstance(r, ev.ToolCalling):
            table.add_row(
                "tool calls: valid / AST",
                r.task,
                f"{r.valid:.3f} / {r.ast_accuracy:.3f}",
                f"{r.questions} questions",
            )
        else:
            table.add_row(
                "acc / acc_norm",
                r.task,
                f"{r.acc:.3f} / {r.acc_norm:.3f}",
                f"{r.questions} questions",
            )
    Console().print(table)
