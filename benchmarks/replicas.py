"""Replicas on Ray Serve: 32 concurrent two-turn chats through `pellucid serve` in one process,
and through `--replicas 1` and `--replicas 2` (prefix-affinity routing, and Ray Serve's own
random pick of two). Per setup: generated tokens/s over both turns, median/min/max over rounds,
and the prefix-cache hit rate of the prompts (each round has a system prompt of its own, so no
round finds an earlier one's KV). The last line is one JSON object.

On a 2-core machine two replicas get one core each, while one engine has both: the figure says
what replicas cost or gain here, not what they give on a machine with a core per replica.

    .venv/bin/python benchmarks/replicas.py [--model smollm2-135m] [--rounds 3] [--chats 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import save, summarize
from serve import pellucid_server

SETUPS = {  # name: `pellucid serve` options
    "one process": [],
    "1 replica": ["--replicas", "1"],
    "2 replicas (prefix)": ["--replicas", "2"],
    "2 replicas (random)": ["--replicas", "2", "--routing", "random"],
}
SYSTEM = (
    "You are a patient maths tutor. Answer in one or two sentences, show the sum you did, "
    "and never use more words than the question needs. "
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--setups", default=",".join(SETUPS))
    args = ap.parse_args()

    results = {}
    for name in args.setups.split(","):
        options = [*SETUPS[name], "--max-waiting", "1024"]
        with pellucid_server(args.model, args.dtype, options) as (url, _):
            asyncio.run(two_turns(url, args, warm_up=True))
            rounds = [asyncio.run(two_turns(url, args)) for _ in range(args.rounds)]
        results[name] = {
            "tokens_per_s": summarize([r["tokens_per_s"] for r in rounds]),
            "prefix_hit_rate": summarize([r["hit_rate"] for r in rounds]),
        }
        tps, hits = results[name]["tokens_per_s"], results[name]["prefix_hit_rate"]
        print(
            f"{name:20s} {tps['median']:7.1f} tok/s (min {tps['min']:.1f}, max {tps['max']:.1f})"
            f"  prefix-cache hits {hits['median']:.1%} (min {hits['min']:.1%})",
            flush=True,
        )
    base = results.get("one process", {}).get("tokens_per_s", {}).get("median")
    for r in results.values():
        r["vs_one_process"] = r["tokens_per_s"]["median"] / base if base else None
    save(
        "replicas",
        {
            "model": args.model,
            "dtype": args.dtype,
            "workload": f"{args.chats} chats at once, two turns each (the second after every "
            f"first is answered), a shared system prompt new each round, greedy, "
            f"{args.max_tokens} tokens a reply at most; {args.rounds} rounds after a warm-up",
            "setups": results,
        },
    )


async def two_turns(url: str, args: argparse.Namespace, warm_up: bool = False) -> dict:
    system = f"Round {uuid.uuid4()}. " + SYSTEM
    questions = [f"What is {i} plus {i + 7}?" for i in range(args.chats if not warm_up else 4)]
    before = prefix_counts(url)
    start = time.perf_counter()
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="-", max_retries=0, timeout=600
    ) as client:

        async def ask(messages: list[dict]) -> tuple[str, int]:
            reply = await client.chat.completions.create(
                model=args.model, messages=messages, temperature=0, max_tokens=args.max_tokens
            )
            return reply.choices[0].message.content or "", reply.usage.completion_tokens

        firsts = [
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in questions
        ]
        answers = await asyncio.gather(*map(ask, firsts))
        seconds = [
            [*m, {"role": "assistant", "content": a}, {"role": "user", "content": "Times two?"}]
            for m, (a, _) in zip(firsts, answers, strict=True)
        ]
        follow_ups = await asyncio.gather(*map(ask, seconds))
    elapsed = time.perf_counter() - start
    after = prefix_counts(url)
    generated = sum(n for _, n in answers + follow_ups)
    queries = after["queries"] - before["queries"]
    return {
        "tokens_per_s": generated / elapsed,
        "hit_rate": (after["hits"] - before["hits"]) / queries if queries else 0.0,
    }


def prefix_counts(url: str) -> dict[str, float]:
    """Prompt tokens looked up in / found in the prefix caches, summed over replicas."""
    counts = {"queries": 0.0, "hits": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            for key in counts:
                if sample.name == f"pellucid:prefix_cache_{key}_total":
                    counts[key] += sample.value
    return counts


if __name__ == "__main__":
    main()
