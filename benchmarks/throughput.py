"""Offline throughput: many requests submitted at once, against the same engine serving one, and
llama.cpp batching the same requests the way its own server does (one context, `n_seq_max` =
the batch, one `llama_decode` per step; see llama_cpp_batch.py).

    .venv/bin/python benchmarks/throughput.py [--model smollm2-135m] [--dtype int4|float32]
        [--compile] [--seqs 1 8 32] [--prompt-tokens 16 24] [--max-tokens 128]
        [--repeats 3] [--rounds 2] [--no-llama-cpp] [--sampled]

The workload is the issue's: each request a prompt of 16-24 random token ids and 128 greedy
new tokens (EOS ignored), all submitted together; the figure is output tokens per second of wall
time, pre-fill included. With --sampled each request samples with the model's recommended
sampling (what a server gives a request that sets none), llama.cpp's sequences each through a
sampler chain of their own with the same settings. Each engine runs in a process of its own (so
each peak RSS is its own: the process's peak, reached at the largest batch), and the engines
take turns (--rounds). Prints median/min/max per batch size, each batch's ratio to its own
single stream and to llama.cpp; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import llama_cpp_batch
from common import peak_rss_mib, recommended_sampling, save, summarize

# torch and pellucid are imported in pellucid's process only: llama.cpp's process would
# otherwise carry torch's ~200 MiB in its peak RSS.
ENGINES = ("pellucid", "llama_cpp")


def workload(n: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    """n prompts of random ids (below 32,000: inside every vocabulary served here)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 32000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="int4", help="int4 (the fast path) or float32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode steps")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[16, 24])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="times the engines take turns")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    ap.add_argument("--sampled", action="store_true", help="the model's recommended sampling")
    ap.add_argument("--sampling", help=argparse.SUPPRESS)  # internal: pellucid's, for llama.cpp
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: measure one engine
    ap.add_argument("--path", help=argparse.SUPPRESS)  # internal: the GGUF, for llama.cpp
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)  # internal: for llama.cpp
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(MEASURE[args.engine](args)))
        return

    import torch

    from pellucid import catalog

    # llama.cpp gets the file pellucid loads and the threads torch uses
    peer_args = [
        "--path",
        str(catalog.resolve(args.model)),
        "--threads",
        str(torch.get_num_threads()),
    ]
    engines = [e for e in ENGINES if not (e == "llama_cpp" and args.no_llama_cpp)]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.rounds):
        for engine in engines:
            if (out := in_subprocess(engine, peer_args)) is not None:
                runs[engine].append(out)
            if engine == "pellucid" and args.sampled and "--sampling" not in peer_args:
                peer_args += ["--sampling", json.dumps(out["sampling"])]
    result: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "compile": args.compile,
        "rounds": args.rounds,
        "workload": f"n requests of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} random "
        f"prompt ids and {args.max_tokens} new tokens each, "
        + (f"sampled ({runs['pellucid'][0]['sampling']})" if args.sampled else "greedy")
        + ", all submitted at once; output tokens per second of wall time, pre-fill included",
    }
    for engine, outs in runs.items():
        if outs:
            result[engine] = pooled(outs, args.seqs)
    report(result, args.seqs)
    save("throughput-sampled" if args.sampled else "throughput", result)


def in_subprocess(engine: str, extra: list[str]) -> dict | None:
    """Measure one engine in a fresh process (the same arguments, plus --engine)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--engine", engine, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{engine} failed:\n{out.stderr[-3000:]}")
    if out.stderr.strip():
        print(out.stderr.strip(), file=sys.stderr)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    return last or None


def pooled(outs: list[dict], seqs: list[int]) -> dict[str, object]:
    """One engine's rounds as one result: every round's values pooled, the highest peak RSS."""
    result: dict[str, object] = {
        f"seqs_{n}_tok_s": summarize([v for out in outs for v in out[str(n)]]) for n in seqs
    }
    result["peak_rss_mib"] = max(out["peak_rss_mib"] for out in outs)
    return result


def report(result: dict, seqs: list[int]) -> None:
    ours, peer = result["pellucid"], result.get("llama_cpp")
    single = ours.get("seqs_1_tok_s")  # measured only where --seqs names 1
    for n in seqs:
        key = f"seqs_{n}_tok_s"
        s = ours[key]
        line = f"{n:3d} sequences  median {s['median']:7.1f}  min {s['min']:7.1f}  "
        line += f"max {s['max']:7.1f} tok/s"
        if single is not None:
            line += f"  x{s['median'] / single['median']:.2f} single stream"
        if peer is not None:
            p = peer[key]
            ratio = result.setdefault("ratios_vs_llama_cpp", {})[key] = round(
                s["median"] / p["median"], 2
            )
            line += f"  | llama.cpp median {p['median']:7.1f} ({p['min']:.1f}-{p['max']:.1f})"
            line += f"  pellucid/llama.cpp {ratio:.2f}x"
        print(line)
    print(f"peak RSS: pellucid {ours['peak_rss_mib']} MiB", end="")
    if peer is not None:
        ratio = round(ours["peak_rss_mib"] / peer["peak_rss_mib"], 2)
        result["ratios_vs_llama_cpp"]["peak_rss"] = ratio
        print(f", llama.cpp {peer['peak_rss_mib']} MiB ({ratio:.2f}x)", end="")
    print()


def measure_pellucid(args: argparse.Namespace) -> dict[str, object]:
    from pellucid import LLM, SamplingParams
    from pellucid.config import EngineConfig

    # No prefix caching: the repeats send the same prompts, and a hit would skip their pre-fill
    llm = LLM(
        args.model,
        dtype=args.dtype,
        engine=EngineConfig(enable_prefix_caching=False, compile=args.compile),
    )
    engine = llm.engine
    sampling = recommended_sampling(llm.sampling_defaults)

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        # plain decoding, as the peers' (drafts: benchmarks/speculative.py)
        params = SamplingParams(
            **(sampling if args.sampled else {"temperature": 0}),
            max_tokens=max_tokens,
            ignore_eos=True,
            speculative=False,
        )
        seqs = [engine.add_request(p, params) for p in prompts]
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start)

    out: dict[str, object] = {}
    for n in args.seqs:
        prompts = workload(n, n, args.prompt_tokens)
        run(prompts, 4)  # warm-up (with --compile: the graph for this many rows)
        out[str(n)] = [run(prompts, args.max_tokens) for _ in range(args.repeats)]
    out["peak_rss_mib"] = round(peak_rss_mib(), 1)
    out["sampling"] = sampling
    return out


def measure_llama_cpp(args: argparse.Namespace) -> dict[str, object]:
    if not llama_cpp_batch.available():
        return {}
    out: dict[str, object] = {}
    for n in args.seqs:
        prompts = workload(n, n, args.prompt_tokens)
        lengths = [args.max_tokens] * n
        seq_len = llama_cpp_batch.seq_len(prompts, lengths)
        sampling = json.loads(args.sampling) if args.sampling else None
        llama = llama_cpp_batch.LlamaCpp(args.path, seq_len, n, args.threads, sampling)
        try:
            llama.generate(prompts, [4] * n)  # warm-up
            out[str(n)] = [
                sum(map(len, outputs)) / seconds
                for outputs, seconds in (
                    llama.generate(prompts, lengths) for _ in range(args.repeats)
                )
            ]
        finally:
            llama.close()
    out["peak_rss_mib"] = round(peak_rss_mib(), 1)
    return out


MEASURE = {"pellucid": measure_pellucid, "llama_cpp": measure_llama_cpp}

if __name__ == "__main__":
    main()
