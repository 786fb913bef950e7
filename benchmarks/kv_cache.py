"""What the KV cache saves: the same greedy tokens generated with the cache and by recomputing the
whole text at every step, after prompts of 128, 512 and 1024 tokens.

    .venv/bin/python benchmarks/kv_cache.py [--model smollm2-135m] [--contexts 128,512,1024]
        [--new-tokens 8] [--repeats 5] [--no-hf]

pellucid's no-cache loop is the one `pellucid explain --compare-no-cache` shows. The peers in the
same run: Hugging Face transformers' `generate(use_cache=True / False)` on the same GGUF (fp32,
dequantized by transformers; needs `accelerate`, which `make bench` installs), and llama.cpp on
the same GGUF and token ids (with its cache, and emptying it before every token: see
llama_cpp_batch.py). Each timing covers the whole request, pre-fill included. Prints median/min/max tokens/s over the repeats and the
ratios; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import llama_cpp_batch
import torch
from common import hf_peer, peak_rss_mib, repeat, save

from pellucid import LLM, SamplingParams
from pellucid.config import EngineConfig
from pellucid.trace.explain import no_cache_comparison


def hf_tokens_per_s(model: torch.nn.Module, ids: list[int], n: int, use_cache: bool) -> float:
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            x,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
        )
    return n / (time.perf_counter() - start)


def measure(
    llm: LLM, hf: torch.nn.Module | None, llama_cpp: bool, ids: list[int], n: int, repeats: int
) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    runs = [no_cache_comparison(llm, ids, params) for _ in range(repeats)]
    row: dict[str, object] = {
        "context": len(ids),
        "pellucid_cached_tok_s": _summary([n / r.cached_s for r in runs]),
        "pellucid_uncached_tok_s": _summary([n / r.uncached_s for r in runs]),
        "pellucid_same_tokens": all(r.same_tokens for r in runs),
        "flops_cached": runs[0].cached_flops,
        "flops_uncached": runs[0].uncached_flops,
    }
    if hf is not None:
        row["hf_cached_tok_s"] = repeat(lambda: hf_tokens_per_s(hf, ids, n, True), repeats)
        row["hf_uncached_tok_s"] = repeat(lambda: hf_tokens_per_s(hf, ids, n, False), repeats)
    if llama_cpp:
        threads = torch.get_num_threads()
        cached = [
            llama_cpp_batch.greedy_batch(llm.path, [ids], [n], threads) for _ in range(repeats)
        ]
        uncached = [
            llama_cpp_batch.greedy_without_cache(llm.path, ids, n, threads) for _ in range(repeats)
        ]
        row["llama_cpp_cached_tok_s"] = _summary([n / s for _, s in cached])
        row["llama_cpp_uncached_tok_s"] = _summary([n / s for _, s in uncached])
        row["llama_cpp_same_tokens"] = cached[0][0][0] == uncached[0][0]
    return row


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1]}


def print_row(row: dict) -> None:
    def cell(key: str) -> str:
        s = row.get(key)
        return "-" if s is None else f"{s['median']:7.1f} ({s['min']:.1f}-{s['max']:.1f})"

    print(
        f"context {row['context']:5d}  pellucid cached {cell('pellucid_cached_tok_s')}  "
        f"uncached {cell('pellucid_uncached_tok_s')}  = {row['pellucid_cache_speedup']:.1f}x  "
        f"FLOPs {row['flops_uncached'] / row['flops_cached']:.1f}x"
    )
    if "llama_cpp_cached_tok_s" in row:
        print(
            f"{'':14s}llama.cpp cached {cell('llama_cpp_cached_tok_s')}  uncached "
            f"{cell('llama_cpp_uncached_tok_s')}  = {row['llama_cpp_cache_speedup']:.1f}x;  "
            f"pellucid/llama.cpp cached {row['pellucid_vs_llama_cpp_cached']:.2f}x"
        )
    if "hf_cached_tok_s" in row:
        print(
            f"{'':14s}HF cached       {cell('hf_cached_tok_s')}  uncached "
            f"{cell('hf_uncached_tok_s')}  = {row['hf_cache_speedup']:.1f}x;  pellucid/HF "
            f"cached {row['pellucid_vs_hf_cached']:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="128,512,1024")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = ap.parse_args()

    # No prefix caching: each repeat must pre-fill its prompt from scratch, as the peer does.
    llm = LLM(args.model, dtype="float32", engine=EngineConfig(enable_prefix_caching=False))
    hf = None if args.no_hf else hf_peer(llm.path)
    llama_cpp = llama_cpp_batch.available()
    text = Path(__file__).with_name("prompt.txt").read_text()
    corpus = llm.encode(text)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        if context > len(corpus):
            raise SystemExit(f"prompt.txt has {len(corpus)} tokens; --contexts asks for {context}")
        ids = corpus[:context]
        no_cache_comparison(llm, ids[:16], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        row = measure(llm, hf, llama_cpp, ids, args.new_tokens, args.repeats)
        med = {k: v["median"] for k, v in row.items() if isinstance(v, dict)}
        row["pellucid_cache_speedup"] = (
            med["pellucid_cached_tok_s"] / med["pellucid_uncached_tok_s"]
        )
        if "llama_cpp_cached_tok_s" in row:
            row["llama_cpp_cache_speedup"] = (
                med["llama_cpp_cached_tok_s"] / med["llama_cpp_uncached_tok_s"]
            )
            row["pellucid_vs_llama_cpp_cached"] = (
                med["pellucid_cached_tok_s"] / med["llama_cpp_cached_tok_s"]
            )
        if hf is not None:
            row["hf_cache_speedup"] = med["hf_cached_tok_s"] / med["hf_uncached_tok_s"]
            row["pellucid_vs_hf_cached"] = med["pellucid_cached_tok_s"] / med["hf_cached_tok_s"]
        rows.append(row)
        print_row(row)
    save(
        "kv_cache",
        {
            "model": args.model,
            "peers": ["transformers"] * (hf is not None) + ["llama.cpp"] * llama_cpp,
            "rows": rows,
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "workload": f"prompt = first N tokens of benchmarks/prompt.txt; {args.new_tokens} greedy "
            f"tokens; {args.repeats} repeats; fp32; timings include pre-fill",
        },
    )


if __name__ == "__main__":
    main()
