"""Speculative decoding from the sequence's own n-grams (engine/drafter.py): decode tok/s with
and without drafts on copy-heavy tasks and on free prose, one stream and 8 at once, against
llama.cpp plain and with its prompt-lookup drafts, in the same run.

    .venv/bin/python benchmarks/speculative.py [--model smollm2-135m] [--repeats 3]
        [--max-tokens 256] [--no-llama-cpp]

Tasks (chat requests, greedy, up to --max-tokens, each ends where the model ends it): a
paragraph of the GPL's preamble rewritten with one word changed, a JSON order re-emitted with
one field changed, an agent turn that quotes a tool's result, a code edit (a function of this
repository with a variable renamed), free prose, and a long file edit (a whole module, ~2,000
tokens, with a variable renamed: guesses at a long context). pellucid runs the default fast path
(int4, the decode steps compiled ahead) in three ways: drafts off, drafts where the engine finds
they pay (the default), and a draft wherever one is found (`speculative=True`). Decode tok/s is
the reply's tokens after the first over the decode steps' time, as `Timings` counts it.
Greedy replies are compared twice, and drafts must leave every reply unchanged on both paths:
on that one (one graph for steps of 1-8 rows, whose rows do not change each other's numbers)
and on the eager int4 path.

llama.cpp (llama-cpp-python, same GGUF, same prompt token ids, same threads) decodes each task
plainly and with `LlamaPromptLookupDecoding` (num_pred_tokens 2, what its documentation
advises on a CPU, and 10, its default), in a process of its own; its rate is the time from its
first token to its last. 8 at once: the five short tasks plus three again in one `generate` call,
total reply tokens over wall time, drafts off and on, each twice a repeat (off, on, on, off;
llama-cpp-python's drafts work on one stream only). Prefix caching is off on both sides, so no
repeat starts warmer. The modes take turns within each repeat (off, auto, always, auto, off),
so a slow minute slows them alike. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import save, summarize

HERE = Path(__file__).parent
ROOT = HERE.parent
MODES = {"off": False, "auto": None, "always": True}  # SamplingParams.speculative
ORDER = {
    "id": "A-10442",
    "customer": {"name": "Maria Gonzalez", "email": "maria.gonzalez@example.com"},
    "items": [
        {"sku": "KB-201", "name": "Mechanical keyboard", "quantity": 1, "price": 89.5},
        {"sku": "MS-044", "name": "Wireless mouse", "quantity": 2, "price": 24.99},
    ],
    "shipping": {"method": "express", "address": "14 Harbour Road, Cork, Ireland"},
    "status": "paid",
}
WEATHER = {
    "location": "Lisbon, Portugal",
    "temperature_c": 21,
    "conditions": "partly cloudy",
    "wind_kmh": 14,
    "humidity_percent": 62,
    "forecast": "light rain expected after 18:00",
    "hourly": [
        {"time": f"{hour}:00", "temperature_c": temperature, "rain_mm": rain}
        for hour, temperature, rain in [
            (15, 21, 0.0),
            (16, 21, 0.0),
            (17, 20, 0.0),
            (18, 19, 0.4),
            (19, 18, 1.2),
            (20, 17, 2.1),
        ]
    ],
}


def gpl_paragraph() -> str:
    text = (HERE / "prompt.txt").read_text()
    start = text.index("  The licenses for most software")
    return " ".join(text[start : text.index("\n\n", start)].split())


def code_snippet() -> str:
    source = (ROOT / "pellucid" / "engine" / "sampling_ops.py").read_text()
    start = source.index("def top_k_mask")
    return source[start : source.index("\n\n\n", start)]


def long_file() -> str:
    """A whole module of this repository (~2,000 tokens): a copy at a long context, where each
    guess's row reads as many keys as its sequence's."""
    return (ROOT / "pellucid" / "engine" / "block_manager.py").read_text()


def tasks() -> dict[str, list[dict]]:
    user = lambda text: [{"role": "user", "content": text}]
    return {
        "paragraph edit": user(
            "Rewrite this paragraph exactly as it is, changing only the word 'freedom' to "
            f"'liberty' wherever it appears:\n\n{gpl_paragraph()}"
        ),
        "json edit": user(
            'Return this JSON document unchanged except that status becomes "shipped":\n\n'
            + json.dumps(ORDER, indent=2)
        ),
        # The request names the form the quote takes: asked only to "quote the result in
        # full", SmolLM2 quoted it in one build's rounding and in another wrote about calling
        # the tool instead, so the task measured the model's whim more than the drafts.
        "quote tool result": [
            {"role": "user", "content": "What is the weather in Lisbon right now?"},
            {
                "role": "assistant",
                "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Lisbon"}}\n</tool_call>',
            },
            {"role": "tool", "content": json.dumps(WEATHER, indent=2)},
            {
                "role": "user",
                "content": "Rewrite the tool's result exactly as it is, in a ```json block, "
                "then tell me whether I need an umbrella.",
            },
        ],
        # The code tasks name the form the copy takes, after the code: asked first to rename a
        # variable and "show the whole function" (or file), SmolLM2 described the code in prose
        # and then repeated itself, so the tasks measured its loops rather than a copy of code.
        "code edit": user(
            f"```python\n{code_snippet()}\n```\n\nCopy this Python function in a ```python "
            "block, with every `kth` replaced by `threshold`. Do not explain it."
        ),
        "free prose": user("Write a short story about a lighthouse keeper who finds a letter."),
        "long file edit": user(
            f"```python\n{long_file()}\n```\n\nCopy this Python file in a ```python block, "
            "with every `block` replaced by `blk`. Do not explain it."
        ),
    }


# the tasks 8 at once are made of: the short ones, and the first three again
SHORT = ["paragraph edit", "json edit", "quote tool result", "code edit", "free prose"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--llama-cpp", help=argparse.SUPPRESS)  # internal: JSON file of prompt ids
    args = ap.parse_args()
    if args.llama_cpp:
        print(json.dumps(measure_llama_cpp(args)))
        return
    result = measure_pellucid(args)
    if not args.no_llama_cpp:
        result["llama_cpp"] = llama_cpp_in_subprocess(args, result)
    print_table(result)
    save("speculative", result)  # prints it: the last line is one JSON object


def measure_pellucid(args: argparse.Namespace) -> dict:
    import torch

    from pellucid import LLM, SamplingParams
    from pellucid.config import EngineConfig

    llm = LLM(args.model, engine=EngineConfig(enable_prefix_caching=False))
    prompts = {name: llm.chat_prompt(messages) for name, messages in tasks().items()}
    base = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    single: dict[str, dict[str, list[float]]] = {t: {m: [] for m in MODES} for t in prompts}
    replies: dict[str, dict[str, list[int]]] = {t: {} for t in prompts}
    drafts: dict[str, dict[str, tuple[int, int]]] = {t: {} for t in prompts}
    batch: dict[str, list[float]] = {m: [] for m in ("off", "auto")}
    batch_replies: dict[str, list[list[int]]] = {}
    batch_drafts = 0  # guesses made in the 8-at-once runs (none: the same steps as off)
    eight = [prompts[name] for name in [*SHORT, *SHORT[:3]]]
    llm.generate(prompts["free prose"], base)  # warm-up
    for _ in range(args.repeats):
        for task, ids in prompts.items():
            # off and auto twice, in both orders, so that a slow stretch of the machine falls
            # on both alike (with off always first, free prose read drafts as a loss that
            # alternating pairs did not: benchmarks/results/comments.md)
            for mode in ("off", "auto", "always", "auto", "off"):
                params = replace(base, speculative=MODES[mode])
                out = llm.generate(ids, params)[0]
                single[task][mode].append(out.timings.decode_tokens_per_s)
                replies[task][mode] = out.token_ids
                drafts[task][mode] = (out.timings.accepted_tokens, out.timings.draft_tokens)
        # Each mode twice a repeat, in both orders, so a slow stretch of the machine falls on
        # both alike: at 8 rows they run the same steps (no guess pays there), and their
        # ratio is the drafter's bookkeeping and the noise.
        for mode in ("off", "auto", "auto", "off"):
            params, rates = replace(base, speculative=MODES[mode]), batch[mode]
            start = time.perf_counter()
            outs = llm.generate(eight, params)
            seconds = time.perf_counter() - start
            rates.append(sum(len(o.token_ids) for o in outs) / seconds)
            batch_replies[mode] = [o.token_ids for o in outs]
            batch_drafts += sum(o.timings.draft_tokens for o in outs)
    return {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "single_stream_decode_tok_s": {
            task: {m: summarize(v) for m, v in modes.items()} for task, modes in single.items()
        },
        "reply_tokens": {task: len(r["off"]) for task, r in replies.items()},
        "same_reply": {
            task: {m: r[m] == r["off"] for m in MODES if m != "off"} for task, r in replies.items()
        },
        "accepted_of_drafted": drafts,
        "eight_at_once_tok_s": {m: summarize(v) for m, v in batch.items()},
        "eight_same_replies": batch_replies["auto"] == batch_replies["off"],
        "eight_drafted_tokens": batch_drafts,
        "same_reply_eager": same_eager(args, prompts, base),
        "prompt_ids": prompts,
        "stop_ids": sorted(llm.tokenizer.eos_ids),
    }


def same_eager(args: argparse.Namespace, prompts: dict[str, list[int]], base) -> dict[str, bool]:
    """Per task, whether drafts leave the greedy reply unchanged on the eager int4 path too."""
    from pellucid import LLM
    from pellucid.config import EngineConfig

    llm = LLM(args.model, engine=EngineConfig(enable_prefix_caching=False, compiled_ahead=False))
    same = {}
    for task, ids in prompts.items():
        off, on = (llm.generate(ids, replace(base, speculative=s))[0] for s in (False, True))
        same[task] = off.token_ids == on.token_ids and on.timings.accepted_tokens > 0
    return same


def llama_cpp_in_subprocess(args: argparse.Namespace, result: dict) -> dict | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({k: result[k] for k in ("prompt_ids", "threads", "stop_ids")}, f)
        f.flush()
        cmd = [sys.executable, __file__, "--llama-cpp", f.name, "--model", args.model]
        cmd += ["--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(f"llama.cpp failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_llama_cpp(args: argparse.Namespace) -> dict | None:
    import llama_cpp_batch

    if not llama_cpp_batch.available():
        return None
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from pellucid import catalog

    spec = json.loads(Path(args.llama_cpp).read_text())
    prompts, threads, stop = spec["prompt_ids"], spec["threads"], set(spec["stop_ids"])
    path = str(catalog.resolve(args.model))
    n_ctx = max(len(p) for p in prompts.values()) + args.max_tokens + 16
    drafts = {"plain": None, "lookup 2": 2, "lookup 10": 10}
    models = {
        name: llama_cpp.Llama(
            model_path=path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            draft_model=None if n is None else LlamaPromptLookupDecoding(num_pred_tokens=n),
            logits_all=n is not None,  # its drafts read the logits of every position
            verbose=False,
        )
        for name, n in drafts.items()
    }
    rates: dict[str, dict[str, list[float]]] = {t: {m: [] for m in models} for t in prompts}
    tokens: dict[str, dict[str, int]] = {t: {} for t in prompts}
    for _ in range(args.repeats):
        for task, ids in prompts.items():
            for name, model in models.items():
                rate, n = _llama_cpp_decode(model, ids, args.max_tokens, stop)
                rates[task][name].append(rate)
                tokens[task][name] = n
    return {
        "version": llama_cpp.__version__,
        "threads": threads,
        "decode_tok_s": {t: {m: summarize(v) for m, v in r.items()} for t, r in rates.items()},
        "reply_tokens": tokens,
    }


def _llama_cpp_decode(model, ids: list[int], max_tokens: int, stop: set[int]) -> tuple[float, int]:
    """(tok/s from the first generated token to the last, tokens generated), greedy, up to an
    end-of-turn token (pellucid's list of them for this model) or max_tokens."""
    model.reset()  # no prefix reuse between repeats
    first = last = time.perf_counter()
    n = 0
    for token in model.generate(ids, temp=0.0, reset=True):
        if token in stop:
            break
        n += 1
        last = time.perf_counter()
        if n == 1:
            first = last
        if n == max_tokens:
            break
    return (n - 1) / (last - first) if n > 1 else 0.0, n


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    single = result["single_stream_decode_tok_s"]
    peer = (result.get("llama_cpp") or {}).get("decode_tok_s", {})
    table = Table(title=f"decode tok/s, one stream, medians ({result['model']}, greedy)")
    same = "same: compiled / eager"
    for col in ["task", "tokens", "off", "auto", "always", "auto/off", same, "taken"]:
        table.add_column(col, justify="left" if col == "task" else "right")
    for col in ["llama.cpp", "lookup 2", "lookup 10", "auto/llama.cpp best"]:
        table.add_column(col, justify="right")
    for task, modes in single.items():
        med = {m: modes[m]["median"] for m in modes}
        taken, drafted = result["accepted_of_drafted"][task]["auto"]
        theirs = {m: v["median"] for m, v in peer.get(task, {}).items()}
        best = max(theirs.values(), default=0.0)
        table.add_row(
            task,
            str(result["reply_tokens"][task]),
            *(f"{med[m]:.0f}" for m in MODES),
            f"{med['auto'] / med['off']:.2f}x",
            ("yes" if all(result["same_reply"][task].values()) else "no")
            + f" / {'yes' if result['same_reply_eager'][task] else 'NO'}",
            f"{taken}/{drafted}",
            *(
                f"{theirs[m]:.0f}" if m in theirs else "-"
                for m in ("plain", "lookup 2", "lookup 10")
            ),
            f"{med['auto'] / best:.2f}x" if best else "-",
        )
    Console(width=220).print(table)
    eight = result["eight_at_once_tok_s"]
    print(
        f"8 at once: off {eight['off']['median']:.0f} tok/s, auto {eight['auto']['median']:.0f} "
        f"tok/s ({eight['auto']['median'] / eight['off']['median']:.2f}x), same replies: "
        f"{result['eight_same_replies']}, guesses made: {result['eight_drafted_tokens']}"
    )
    geo = statistics.geometric_mean(
        single[t]["auto"]["median"] / single[t]["off"]["median"]
        for t in single
        if t != "free prose"
    )
    print(f"copy-heavy tasks, auto/off geometric mean: {geo:.2f}x")


if __name__ == "__main__":
    main()
