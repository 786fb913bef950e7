"""Latency of one request: load time, pre-fill tok/s of a 512-token prompt, decode tok/s for
128 tokens, peak RSS. Prints median/min/max over repeats; the last line is one JSON object.

    .venv/bin/python benchmarks/latency.py [--model smollm2-135m] [--dtype float32] [--repeats 5]
        [--no-hf]

Peer in the same run: Hugging Face transformers on the same GGUF (fp32, `make bench` installs what
it needs), measured after pellucid so pellucid's peak RSS is its own. Its decode rate is
(n - 1) tokens over generate(n) minus generate(1), so its pre-fill is not counted as decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import torch
from common import hf_peer, peak_rss_mib, repeat, save

from pellucid import LLM, SamplingParams
from pellucid.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = ap.parse_args()

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
    if not args.no_hf:
        hf = measure_hf(llm.path, prompt, short, args.decode_tokens, args.repeats)
        if hf is not None:
            result["hf"] = hf
            result["ratios_vs_hf"] = {k: round(result[k]["median"] / hf[k]["median"], 2)
                                      for k in keys}
            for k in keys:
                print(f"HF {k:25s} median {hf[k]['median']:8.1f}   pellucid/HF "
                      f"{result['ratios_vs_hf'][k]:.2f}x")
            print(f"HF {'load_s':25s} {hf['load_s']:.2f}")
    save("latency", result)


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
