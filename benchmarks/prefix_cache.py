"""Prefix caching: time to first token (TTFT) of a chat request whose ~400-token system prompt is
already cached from an earlier request, against the first request that had to compute it.

    .venv/bin/python benchmarks/prefix_cache.py [--model smollm2-135m] [--repeats 5]

Each repeat uses a fresh engine (cold cache) and a different system prompt; the last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import save

from pellucid import LLM, SamplingParams
from pellucid.engine.llm_engine import LLMEngine


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first sampled token, and the prompt tokens found cached."""
    start = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while not seq.output_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed, seq.num_cached


def chat(llm: LLM, system: str, question: str) -> list[int]:
    return llm.chat_prompt(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    llm = LLM(args.model, dtype="float32")
    words = Path(__file__).with_name("prompt.txt").read_text().split()
    rows = []
    for r in range(args.repeats + 1):  # the first round warms up and is not counted
        system = " ".join(words[r * 40 :])  # a different system prompt each round
        system_ids = llm.tokenizer.encode(system)[: args.system_tokens]
        system = llm.tokenizer.decode(system_ids)

        engine = LLMEngine(llm.model, llm.tokenizer, llm.kv_dtype, llm.engine.config)
        first, _ = ttft(engine, chat(llm, system, "Summarize the text above in one sentence."))
        second, cached = ttft(engine, chat(llm, system, "Who may copy this document?"))
        if r:
            rows.append((first, second, cached))
    firsts = sorted(f for f, _, _ in rows)
    seconds = sorted(s for _, s, _ in rows)
    ratios = sorted(s / f for f, s, _ in rows)
    med = len(rows) // 2
    print(
        f"first request TTFT   median {firsts[med] * 1000:7.1f} ms  "
        f"min {firsts[0] * 1000:7.1f}  max {firsts[-1] * 1000:7.1f}"
    )
    print(
        f"second (cached) TTFT median {seconds[med] * 1000:7.1f} ms  "
        f"min {seconds[0] * 1000:7.1f}  max {seconds[-1] * 1000:7.1f}"
    )
    print(
        f"second / first       median {ratios[med]:.3f}  (prompt tokens from cache: {rows[0][2]})"
    )
    save(
        "prefix_cache",
        {
            "model": args.model,
            "workload": f"chat with a {args.system_tokens}-token system prompt, two user questions",
            "first_ttft_s": {"median": firsts[med], "min": firsts[0], "max": firsts[-1]},
            "second_ttft_s": {"median": seconds[med], "min": seconds[0], "max": seconds[-1]},
            "second_over_first": {"median": ratios[med], "min": ratios[0], "max": ratios[-1]},
            "cached_prompt_tokens": rows[0][2],
        },
    )


if __name__ == "__main__":
    main()
