"""Offline throughput: many requests at once through the batching engine (nano-vllm's workload,
scaled to a small CPU), against the same engine serving one request at a time.

    .venv/bin/python benchmarks/throughput.py [--model smollm2-135m] [--dtype int4|float32]
        [--compile] [--seqs 8 32] [--repeats 3]

Prints median/min/max of aggregate decode tokens/s per batch size and the ratio to single-stream
decode measured in the same run, and llama.cpp on the same requests (same GGUF, token ids and
threads; see llama_cpp_batch.py) where llama-cpp-python is installed; the last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import llama_cpp_batch
import torch
from common import peak_rss_mib, repeat, save

from pellucid import LLM, SamplingParams
from pellucid.config import EngineConfig


def workload(n: int, vocab: int, seed: int, max_in: int, max_out: int):
    """n requests with random prompt ids and lengths (as nano-vllm's bench.py does)."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(rng.randint(16, max_in))] for _ in range(n)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(16, max_out), ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


def run_batch(llm: LLM, prompts, params) -> float:
    """All requests submitted at once; output tokens per second of wall time."""
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    return sum(len(s.output_ids) for s in seqs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="int4", help="int4 (the fast path) or float32")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode steps")
    args = ap.parse_args()

    # No prefix caching: the repeats send the same prompts, and a cache hit would skip their
    # pre-fill, while llama.cpp starts every batch from an empty context.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        compile=args.compile,
        engine=EngineConfig(enable_prefix_caching=False),
    )
    vocab = llm.config.vocab_size
    one_prompt, one_params = workload(1, vocab, 0, args.max_input, args.max_output)
    one_params[0].max_tokens = args.max_output
    run_batch(llm, one_prompt, one_params)  # warm-up
    single = repeat(lambda: run_batch(llm, one_prompt, one_params), args.repeats)
    print(
        f"{'1 sequence':14s} median {single['median']:8.1f}  min {single['min']:8.1f}  "
        f"max {single['max']:8.1f} tok/s"
    )
    result: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "compile": args.compile,
        "single_stream_tok_s": single,
    }
    for n in args.seqs:
        prompts, params = workload(n, vocab, n, args.max_input, args.max_output)
        # Warm-up: short prompts pre-fill in one step, so the n rows then decode together
        # (with --compile: compiles the graph for this many rows before the timing)
        warm = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * n
        run_batch(llm, [p[:8] for p in prompts], warm)
        stats = repeat(lambda p=prompts, sp=params: run_batch(llm, p, sp), args.repeats)
        ratio = stats["median"] / single["median"]
        print(
            f"{n:3d} sequences   median {stats['median']:8.1f}  min {stats['min']:8.1f}  "
            f"max {stats['max']:8.1f} tok/s   x{ratio:.2f} single stream"
        )
        result[f"seqs_{n}_tok_s"] = stats
        result[f"seqs_{n}_vs_single"] = round(ratio, 2)
        peer = llama_cpp_peer(llm, prompts, params, args.repeats)
        if peer is not None:
            result[f"llama_cpp_seqs_{n}_tok_s"] = peer
            result[f"seqs_{n}_vs_llama_cpp"] = round(stats["median"] / peer["median"], 2)
            print(
                f"    llama.cpp  median {peer['median']:8.1f}  min {peer['min']:8.1f}  "
                f"max {peer['max']:8.1f} tok/s   pellucid/llama.cpp "
                f"{stats['median'] / peer['median']:.2f}x"
            )
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    result["workload"] = (
        f"random prompts of 16-{args.max_input} ids, 16-{args.max_output} "
        "greedy output tokens each, all submitted at once"
    )
    save("throughput", result)


def llama_cpp_peer(llm: LLM, prompts, params, repeats: int) -> dict[str, float] | None:
    """The same requests through llama.cpp (same GGUF, same ids, same threads), or None."""
    if not llama_cpp_batch.available():
        return None
    lengths = [sp.max_tokens for sp in params]
    threads = torch.get_num_threads()
    return repeat(
        lambda: llama_cpp_batch.greedy_batch_tok_s(llm.path, prompts, lengths, threads), repeats
    )


if __name__ == "__main__":
    main()
