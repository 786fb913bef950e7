"""BIG-bench's tasks as `pellucid eval` tasks: `--task bigbench:hindu_knowledge`.

The `bigbench==1.0.0` source archive on the package index holds every task's `task.json` (Apache
2.0). Its examples give an `input` and either `target_scores` (choice -> 1 if right: a
multiple-choice question) or `target` (the answer, or a list of accepted ones: a generation
check). A question is the input between the task's prefixes (BIG-bench's defaults: "\\nQ: " and
"\\nA: "), each choice a continuation that takes the last prefix's trailing space; a generation
prompt ends with the last prefix, its trailing space dropped. The archive (~360 MB) is fetched
once with pip into the cache, and a task, once read, is kept there as JSONL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from pellucid.atomic import atomic_path
from pellucid.weights.cache import cache_root

PACKAGE = "bigbench==1.0.0"
ARCHIVE = "bigbench-1.0.0.tar.gz"
PREFIX = "bigbench:"
SHOTS = 3  # answered examples before a generation prompt (BIG-bench's largest few-shot count)


def task_file(name: str) -> Path:
    """The JSONL of BIG-bench task `name` (its multiple-choice examples, or, in a task with
    none, its generation examples), made on first use.
    A subtask is named by its folder too: `abstract_narrative_understanding/4_distractors`."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bigbench:{name}: not a task name (a folder of benchmark_tasks)")
    out = cache_root() / "bigbench" / f"{'__'.join(parts)}.jsonl"
    if out.is_file():
        return out
    with atomic_path(out) as tmp:
        tmp.write_text("".join(json.dumps(doc) + "\n" for doc in to_docs(read_task(name))))
    return out


def read_task(name: str) -> dict:
    member = f"bigbench-1.0.0/bigbench/benchmark_tasks/{name}/task.json"
    with tarfile.open(archive()) as tar:
        try:
            f = tar.extractfile(member)
        except KeyError:
            raise ValueError(
                f"bigbench:{name}: no such task in {PACKAGE} (names are the folders of "
                "bigbench/benchmark_tasks, e.g. hindu_knowledge, anachronisms)"
            ) from None
        return json.load(f)


def to_docs(task: dict) -> list[dict]:
    """A task's multiple-choice questions, or its generation checks if it has no questions."""
    try:
        return to_questions(task)
    except ValueError:
        return to_prompts(task)


def to_prompts(task: dict, shots: int = SHOTS) -> list[dict]:
    """BIG-bench examples with a `target` -> {"prompt", "targets", "stop"}: each prompt starts
    with the task's first `shots` examples answered (joined by its separator, as BIG-bench
    writes few-shot prompts; those examples are not asked), and a reply ends at the task's
    stop string, else at its separator or a line break."""
    before = task.get("example_input_prefix", "\nQ: ")
    after = task.get("example_output_prefix", "\nA: ")
    separator = task.get("few_shot_example_separator", "\n")
    examples = []
    for ex in task.get("examples", []):
        target = ex.get("target")
        targets = [target] if isinstance(target, str) else target
        if targets and all(isinstance(t, str) for t in targets):
            examples.append((f"{before}{ex['input']}{after}".lstrip("\n"), targets))
    if len(examples) <= shots:
        raise ValueError(f"bigbench:{task.get('name')}: no examples with choices or targets")
    shown = "".join(q + targets[0] + separator for q, targets in examples[:shots])
    stop = [task["stop_string"]] if task.get("stop_string") else [separator.strip() or "\n"]
    return [
        {"prompt": (shown + q).rstrip(" "), "targets": targets, "stop": sorted({*stop, "\n"})}
        for q, targets in examples[shots:]
    ]


def to_questions(task: dict) -> list[dict]:
    """BIG-bench examples with `target_scores` -> {"question", "choices", "answer"}; the
    examples without (generation tasks) are left out."""
    before = task.get("example_input_prefix", "\nQ: ")
    after = task.get("example_output_prefix", "\nA: ")
    out = []
    for ex in task.get("examples", []):
        scores = ex.get("target_scores")
        if not scores or len(scores) < 2:
            continue
        choices = list(scores)
        best = max(scores.values())
        question = f"{before}{ex['input']}{after}".lstrip("\n")
        # the prefix's last space goes with each choice (" Yes" is one token, "Yes" after a
        # lone " " two), as lm-evaluation-harness joins question and answer
        space = " " if question.endswith(" ") else ""
        out.append(
            {
                "question": question.removesuffix(space),
                "choices": [space + c for c in choices],
                "answer": next(i for i, c in enumerate(choices) if scores[c] == best),
            }
        )
    if not out:
        raise ValueError(f"bigbench:{task.get('name')}: no multiple-choice examples in it")
    return out


def archive() -> Path:
    folder = cache_root() / "bigbench"
    path = folder / ARCHIVE
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(folder),
            PACKAGE,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not path.is_file():
            raise ValueError(f"could not fetch {PACKAGE} ({' '.join(cmd)}): {done.stderr[-300:]}")
    return path
