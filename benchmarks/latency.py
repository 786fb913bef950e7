"""Latency of one request: load time, pre-fill tok/s of a 512-token prompt, decode tok/s for
128 tokens, peak RSS. Prints median/min/max over repeats; the last line is one JSON object.

    .venv/bin/python benchmarks/latency.py [--model smollm2-135m] [--dtype float32] [--repeats 5]
        [--no-hf] [--no-llama-cpp]

Peers in the same run, on the same GGUF and the same token ids, measured after pellucid so that
pellucid's peak RSS is its own (`make bench` installs both): llama.cpp (llama-cpp-python, the
quantized weights, torch's thread count) and Hugging Face transformers (fp32). HF's decode rate is
(n - 1) tokens over generate(n) minus generate(1), llama.cpp's the time from its first generated
token to its n-th, so neither counts pre-fill as decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import torch
from common import hf_peer, peak_rss_mib, repeat, save

from pellucid import LLM, SamplingParams, catalog
from pellucid.config import EngineConfig
from pellucid.weights.loader import read_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    args = ap.parse_args()

    read_checkpoint(catalog.resolve(args.model))  # fills the weight cache: the load below is warm
    start = time.perf_counter()
    # No prefix caching: every repeat must pre-fill the same prompt from scratch.
    llm = LLM(args.model, dtype=args.dtype, engine=EngineConfig(enable_prefix_caching=False))
    load_s = time.perf_counter() - start
    text = Path(__file__).with_name("prompt.txt").read_text()
    prompt = llm.encode(text)[: args.prompt_tokens]
    short = llm.encode("The history of the printing press")

    def prefill() -> float:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
        return out.timings.prefill_tokens_per_s

    def decode(ids: list[int]) -> float:
        params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        return llm.generate(ids, params)[0].timings.decode_tokens_per_s

    prefill()  # warm-up
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "load_s": round(load_s, 3),
        "prefill_tok_s": repeat(prefill, args.repeats),
        "decode_tok_s_short_context": repeat(lambda: decode(short), args.repeats),
        "decode_tok_s_after_512": repeat(lambda: decode(prompt), args.repeats),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "workload": f"{len(prompt)}-token prompt; {args.decode_tokens} greedy tokens",
    }
    keys = ("prefill_tok_s", "decode_tok_s_short_context", "decode_tok_s_after_512")
    for key in keys:
        s = result[key]
        print(f"{key:28s} median {s['median']:8.1f}  min {s['min']:8.1f}  max {s['max']:8.1f}")
    print(f"{'load_s':28s} {load_s:.2f}   peak RSS {result['peak_rss_mib']} MiB")
    peers = {
        "llama_cpp": None if args.no_llama_cpp else measure_llama_cpp,
        "hf": None if args.no_hf else measure_hf,
    }
    for name, measure in peers.items():
        peer = measure and measure(llm.path, prompt, short, args.decode_tokens, args.repeats)
        if not peer:
            continue
        result[name] = peer
        ratios = {k: round(result[k]["median"] / peer[k]["median"], 2) for k in keys}
        result[f"ratios_vs_{name}"] = ratios
        for k in keys:
            print(f"{name} {k:26s} median {peer[k]['median']:8.1f}   pellucid/{name} "
                  f"{ratios[k]:.2f}x")
        print(f"{name} {'load_s':26s} {peer['load_s']:.2f}")
    save("latency", result)


def measure_llama_cpp(path: str, prompt: list[int], short: list[int], n: int,
                      repeats: int) -> dict[str, object] | None:
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama.cpp peer skipped: {e} (make bench installs llama-cpp-python)",
              file=sys.stderr)
        return None
    threads = torch.get_num_threads()
    start = time.perf_counter()
    model = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                            n_ctx=len(prompt) + n + 8, n_batch=len(prompt), verbose=False)
    load_s = time.perf_counter() - start

    def prefill() -> float:
        model.reset()
        start = time.perf_counter()
        model.eval(prompt)
        return len(prompt) / (time.perf_counter() - start)

    def decode(ids: list[int]) -> float:
        model.reset()
        first = None
        for i, _ in enumerate(model.generate(ids, temp=0.0), 1):
            if i == 1:
                first = time.perf_counter()
            if i == n:
                break
        return (n - 1) / (time.perf_counter() - first)

    prefill()  # warm-up
    return {
        "version": llama_cpp.__version__,
        "threads": threads,
        "load_s": round(load_s, 3),
        "prefill_tok_s": repeat(prefill, repeats),
        "decode_tok_s_short_context": repeat(lambda: decode(short), repeats),
        "decode_tok_s_after_512": repeat(lambda: decode(prompt), repeats),
    }


def measure_hf(path: str, prompt: list[int], short: list[int], n: int,
               repeats: int) -> dict[str, object] | None:
    start = time.perf_counter()
    model = hf_peer(path)
    if model is None:
        return None
    load_s = time.perf_counter() - start

    def generate_s(ids: list[int], new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def prefill() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model(torch.tensor([prompt]))
        return len(prompt) / (time.perf_counter() - start)

    def decode(ids: list[int]) -> float:
        return (n - 1) / (generate_s(ids, n) - generate_s(ids, 1))

    prefill()  # warm-up
    return {
        "load_s": round(load_s, 3),
        "prefill_tok_s": repeat(prefill, repeats),
        "decode_tok_s_short_context": repeat(lambda: decode(short), repeats),
        "decode_tok_s_after_512": repeat(lambda: decode(prompt), repeats),
    }


if __name__ == "__main__":
    main()
