"""Latency of one request: load time, pre-fill tok/s of a 512-token prompt, decode tok/s for
128 tokens (plain decoding: no speculative drafts), greedy and with the model's recommended
sampling (temperature, top-k, top-p: what a server or chat gives a request that sets none), peak
RSS. Prints median/min/max over repeats; the last line is one JSON object.

    .venv/bin/python benchmarks/latency.py [--model smollm2-135m] [--dtype int4|float32]
        [--compile] [--repeats 5] [--rounds 2] [--no-hf] [--no-llama-cpp]

Peers in the same run, on the same GGUF and the same token ids (`make bench` installs both):
llama.cpp (llama-cpp-python, the quantized weights, torch's thread count) and Hugging Face
transformers (fp32). Each engine runs in a process of its own, so each peak RSS is its own. HF's
decode rate is (n - 1) tokens over generate(n) minus generate(1), llama.cpp's the time from its
first generated token to its n-th, so neither counts pre-fill as decode. The engines take turns
(--rounds): each round runs each engine once, with --repeats measurements, and the statistics
pool all rounds, so a neighbour that slows the machine for a minute slows every engine alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import llama_cpp_batch
from common import SAMPLING, hf_peer, peak_rss_mib, recommended_sampling, repeat, save, summarize

# torch and pellucid are imported where pellucid and transformers are measured, not at the top:
# the llama.cpp peer's process would otherwise carry torch's ~200 MiB in its peak RSS.


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="int4", help="int4 (the fast path) or float32 (reference)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="times the engines take turns")
    ap.add_argument("--compile", action="store_true", help="torch.compile pellucid's decode step")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: measure one engine, print JSON
    ap.add_argument("--ids", help=argparse.SUPPRESS)  # internal: the prompts' token ids (JSON)
    args = ap.parse_args()
    if args.engine:
        ids = json.loads(Path(args.ids).read_text()) if args.ids else None
        print(json.dumps(MEASURE[args.engine](args, ids)))
        return

    import torch

    from pellucid import catalog
    from pellucid.loading.loader import load_int4, read_checkpoint

    # Fill the weight cache that this dtype's load reads, so the timed load is a warm one
    path = catalog.resolve(args.model)
    (load_int4 if args.dtype == "int4" else read_checkpoint)(path)
    peers = [name for name in ("llama_cpp", "hf") if not getattr(args, f"no_{name}")]
    runs: dict[str, list[dict]] = {name: [] for name in ["pellucid", *peers]}
    ids = None
    for _ in range(args.rounds):
        for name, done in runs.items():
            out = in_subprocess(name, args, ids)
            if name == "pellucid" and ids is None:  # the peers run pellucid's token ids
                ids = {
                    "prompt": out["prompt_ids"],
                    "short": out["short_ids"],
                    "path": str(path),
                    "threads": torch.get_num_threads(),
                    "sampling": out["sampling"],
                }
            if out:
                done.append(out)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "compile": args.compile,
        "rounds": args.rounds,
        **pooled(runs["pellucid"]),
    }
    result["workload"] = (
        f"{len(ids['prompt'])}-token prompt; {args.decode_tokens} greedy tokens, and "
        f"{args.decode_tokens} sampled after the short prompt ({ids['sampling']})"
    )
    for key in KEYS:
        s = result[key]
        print(f"{key:28s} median {s['median']:8.1f}  min {s['min']:8.1f}  max {s['max']:8.1f}")
    print(f"{'load_s':28s} {result['load_s']:.2f}   peak RSS {result['peak_rss_mib']} MiB")
    print(f"{'decode steps compiled ahead':28s} {result['compiled_ahead'] or 'none (eager)'}")
    for name in peers:
        if not runs[name]:
            continue
        peer = result[name] = pooled(runs[name])
        ratios = {k: round(result[k]["median"] / peer[k]["median"], 2) for k in KEYS}
        ratios["peak_rss"] = round(result["peak_rss_mib"] / peer["peak_rss_mib"], 2)
        result[f"ratios_vs_{name}"] = ratios
        for k in KEYS:
            print(
                f"{name} {k:26s} median {peer[k]['median']:8.1f}   pellucid/{name} {ratios[k]:.2f}x"
            )
        print(
            f"{name} {'load_s':26s} {peer['load_s']:.2f}   peak RSS {peer['peak_rss_mib']} MiB "
            f"(pellucid/{name} {ratios['peak_rss']:.2f}x)"
        )
    # one file per mode, so an eager or float32 run does not overwrite the fast path's result
    step = "" if args.compile else "-ahead" if result["compiled_ahead"] else "-eager"
    mode = step + ("" if args.dtype == "int4" else f"-{args.dtype}")
    save(f"latency{mode}", result)


KEYS = (
    "prefill_tok_s",
    "decode_tok_s_short_context",
    "decode_tok_s_after_512",
    "decode_tok_s_sampled",
)


def pooled(outs: list[dict]) -> dict[str, object]:
    """One engine's rounds as one result: the speeds' statistics over every round's values,
    the (higher) median load time, the highest peak RSS."""
    result = {k: v for k, v in outs[0].items() if k not in ("prompt_ids", "short_ids")}
    for key in KEYS:
        result[key] = summarize([v for out in outs for v in out[key]["values"]])
    result["load_s"] = statistics.median_high(out["load_s"] for out in outs)
    result["peak_rss_mib"] = max(out["peak_rss_mib"] for out in outs)
    return result


def in_subprocess(engine: str, args: argparse.Namespace, ids: dict | None) -> dict | None:
    """Measure one engine in a fresh process, so that each peak RSS is that engine's own."""
    cmd = [
        sys.executable,
        __file__,
        "--engine",
        engine,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--decode-tokens",
        str(args.decode_tokens),
        "--repeats",
        str(args.repeats),
    ] + ["--compile"] * args.compile
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        if ids is not None:
            json.dump(ids, f)
            f.flush()
            cmd += ["--ids", f.name]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{engine} failed:\n{out.stderr[-3000:]}")
    if out.stderr.strip():
        print(out.stderr.strip(), file=sys.stderr)
    last = out.stdout.strip().splitlines()[-1]
    return json.loads(last)


def measure_pellucid(args: argparse.Namespace, _ids: dict | None) -> dict[str, object]:
    from pellucid import LLM, SamplingParams
    from pellucid.config import EngineConfig

    start = time.perf_counter()
    # No prefix caching: every repeat must pre-fill the same prompt from scratch.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        engine=EngineConfig(enable_prefix_caching=False, compile=args.compile),
    )
    load_s = time.perf_counter() - start
    text = Path(__file__).with_name("prompt.txt").read_text()
    prompt = llm.encode(text)[: args.prompt_tokens]
    short = llm.encode("The history of the printing press")

    def prefill() -> float:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
        return out.timings.prefill_tokens_per_s

    sampling = recommended_sampling(llm.sampling_defaults)

    def decode(ids: list[int], **sampled: float) -> float:
        # Without drafts: plain decoding against the peers' (a greedy reply that loops would
        # be guessed, which benchmarks/speculative.py measures on its own)
        params = SamplingParams(
            **(sampled or {"temperature": 0}),
            max_tokens=args.decode_tokens,
            ignore_eos=True,
            speculative=False,
        )
        return llm.generate(ids, params)[0].timings.decode_tokens_per_s

    prefill()  # warm-up
    decode(short)  # with --compile: compiles the decode step (not timed)
    decode_step = llm.engine.model_runner.compiled_decode
    return {
        "load_s": round(load_s, 3),
        # which decode steps are compiled ahead (`pellucid compile`): [] when all run eagerly
        "compiled_ahead": sorted(decode_step.ahead) if decode_step is not None else [],
        "prefill_tok_s": repeat(prefill, args.repeats),
        "decode_tok_s_short_context": repeat(lambda: decode(short), args.repeats),
        "decode_tok_s_after_512": repeat(lambda: decode(prompt), args.repeats),
        "decode_tok_s_sampled": repeat(lambda: decode(short, **sampling), args.repeats),
        "sampling": sampling,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "prompt_ids": prompt,
        "short_ids": short,
    }


def measure_llama_cpp(args: argparse.Namespace, ids: dict) -> dict[str, object] | None:
    path, prompt, short, threads = ids["path"], ids["prompt"], ids["short"], ids["threads"]
    n, repeats = args.decode_tokens, args.repeats
    if not llama_cpp_batch.available():
        return None
    import llama_cpp

    start = time.perf_counter()
    model = llama_cpp.Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=len(prompt) + n + 8,
        n_batch=len(prompt),
        verbose=False,
    )
    load_s = time.perf_counter() - start

    def prefill() -> float:
        model.reset()
        start = time.perf_counter()
        model.eval(prompt)
        return len(prompt) / (time.perf_counter() - start)

    def decode(ids: list[int], **sampled: float) -> float:
        model.reset()
        first = None
        # its generate's defaults filter (top_k 40, top_p 0.95, min_p 0.05): each set here
        settings = {**SAMPLING, "temperature": 0.0, **sampled}
        kwargs = {"temp": settings.pop("temperature"), **settings, "repeat_penalty": 1.0}
        for i, _ in enumerate(model.generate(ids, **kwargs), 1):
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
        "decode_tok_s_sampled": repeat(lambda: decode(short, **ids["sampling"]), repeats),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def measure_hf(args: argparse.Namespace, ids: dict) -> dict[str, object] | None:
    import torch

    path, prompt, short = ids["path"], ids["prompt"], ids["short"]
    n, repeats = args.decode_tokens, args.repeats
    start = time.perf_counter()
    model = hf_peer(path)
    if model is None:
        return None
    load_s = time.perf_counter() - start

    def generate_s(ids: list[int], new: int, **sampled: float) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=bool(sampled),
                pad_token_id=0,
                **sampled,
            )
        return time.perf_counter() - start

    def prefill() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model(torch.tensor([prompt]))
        return len(prompt) / (time.perf_counter() - start)

    def decode(ids: list[int], **sampled: float) -> float:
        return (n - 1) / (generate_s(ids, n, **sampled) - generate_s(ids, 1, **sampled))

    prefill()  # warm-up
    return {
        "load_s": round(load_s, 3),
        "prefill_tok_s": repeat(prefill, repeats),
        "decode_tok_s_short_context": repeat(lambda: decode(short), repeats),
        "decode_tok_s_after_512": repeat(lambda: decode(prompt), repeats),
        "decode_tok_s_sampled": repeat(lambda: decode(short, **ids["sampling"]), repeats),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


MEASURE = {"pellucid": measure_pellucid, "llama_cpp": measure_llama_cpp, "hf": measure_hf}

if __name__ == "__main__":
    main()
