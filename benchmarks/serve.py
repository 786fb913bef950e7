"""Serving under load: 1, 4, 16 and 32 concurrent streaming chat requests through `pellucid serve`
on loopback, driven by the official `openai` client. Per level: time to first token and the gap
between streamed chunks (p50/p99) and aggregate generated tokens/s, median/min/max over repeats.
`--check` also asserts that every greedy reply at the highest level equals the request run alone.
The last line is one JSON object.

    .venv/bin/python benchmarks/serve.py [--model smollm2-135m] [--levels 1 4 16 32] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import repeat, save


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (EOS ignored)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="greedy replies under load == alone")
    args = ap.parse_args()

    with pellucid_server(args.model, args.dtype, ["--max-waiting", "1024"]) as (url, _):
        asyncio.run(one_batch(url, args.model, 1, args.max_tokens))  # warm-up
        levels = [measure_level(url, args, c) for c in args.levels]
        check = None
        if args.check:
            check = check_greedy(url, args.model, max(args.levels), args.max_tokens)
    for lv in levels:
        print(
            f"concurrency {lv['concurrency']:3d}: {lv['tokens_per_s']['median']:8.1f} tok/s  "
            f"TTFT p50 {lv['ttft_p50_s']['median'] * 1000:7.0f} ms  "
            f"p99 {lv['ttft_p99_s']['median'] * 1000:7.0f} ms  "
            f"ITL p50 {lv['itl_p50_s']['median'] * 1000:6.1f} ms  "
            f"p99 {lv['itl_p99_s']['median'] * 1000:6.1f} ms"
        )
    save(
        "serve",
        {
            "model": args.model,
            "dtype": args.dtype,
            "workload": f"streaming chat, {args.max_tokens} greedy tokens per request (EOS ignored), "
            f"{args.repeats} repeats per level; ITL = gap between streamed chunks",
            "levels": levels,
            "greedy_equal_under_load": check,
        },
    )


def measure_level(url: str, args: argparse.Namespace, concurrency: int) -> dict:
    runs: list[dict] = []

    def once() -> float:
        runs.append(asyncio.run(one_batch(url, args.model, concurrency, args.max_tokens)))
        return runs[-1]["tokens_per_s"]

    result: dict[str, object] = {"concurrency": concurrency}
    result["tokens_per_s"] = repeat(once, args.repeats)
    for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
        result[key] = spread([r[key] for r in runs])
    return result


async def one_batch(url: str, model: str, n: int, max_tokens: int) -> dict:
    """n concurrent streams; their TTFTs, chunk gaps and the aggregate generated tokens/s."""
    # A client per batch: each batch runs in its own event loop, which its connections belong to.
    async with client_for(url) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream(client, model, i, max_tokens) for i in range(n)))
        wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]] or [0.0]
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "texts": [r["text"] for r in results],
    }


async def stream(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    chunks = await client.chat.completions.create(
        model=model,
        messages=conversation(i),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    times, text, tokens = [], "", 0
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttft = (times[0] if times else time.perf_counter()) - start
    return {
        "ttft": ttft,
        "gaps": [b - a for a, b in itertools.pairwise(times)],
        "text": text,
        "tokens": tokens,
    }


def check_greedy(url: str, model: str, n: int, max_tokens: int) -> bool:
    """Every reply of n concurrent greedy requests equals the same request sent alone."""
    together = asyncio.run(one_batch(url, model, n, max_tokens))["texts"]

    async def alone() -> list[str]:
        async with client_for(url) as client:
            return [(await stream(client, model, i, max_tokens))["text"] for i in range(n)]

    expected = asyncio.run(alone())
    for i, (got, want) in enumerate(zip(together, expected)):
        if got != want:
            print(f"request {i} differs under load:\n  {got!r}\n  {want!r}", file=sys.stderr)
    print(f"greedy replies of {n} concurrent requests equal to alone: {together == expected}")
    return together == expected


def conversation(i: int) -> list[dict]:
    topics = ["the sea", "bread", "the moon", "trains", "bees", "maps", "rain", "chess"]
    return [{"role": "user", "content": f"Write about {topics[i % len(topics)]} (#{i})."}]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)


@contextlib.contextmanager
def pellucid_server(
    model: str, dtype: str, options: list[str]
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`pellucid serve` (with more command-line `options`) in a child process on a free loopback
    port; yields its URL and the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "pellucid",
        "serve",
        "--model",
        model,
        "--dtype",
        dtype,
        "--port",
        str(port),
        *options,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(cmd)}` did not become healthy")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
