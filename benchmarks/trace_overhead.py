"""What tracing one request costs the others, and its own pre-fill.

1. 16 requests decode together, once with none traced and once with one traced; the 15 untraced
   requests' tokens/s are compared, per second of wall time and of CPU time, in back-to-back pairs
   (median of the paired ratios; each side first in turn), and by each step's median across the
   repeats, summed over the batch's steps (a noisy second moves one repeat's step, where it
   moves a whole pair's ratio), plus what the trace's own work took
   (its own clock, immune to neighbours): recording inside the shared steps, and the analysis
   pass, as a share of the batch's time (the engine runs one thing at a time: the batch waits).
   The trace holds attention at every layer and the logit lens (`--basic`: tokens, stages,
   timings and KV only: what the explorer records, which asks `/v1/inspect` for a token's
   attention and lens when one is clicked). Request 0 (traced or not) asks half as many tokens
   as the others, so the pass that finds its decoded tokens' attention and lens once it is done
   runs while the others still decode: they pay for it (its prompt's are kept in flight, in
   the first step, which every request shares). Reading the
   trace (sampling stages and the logit lens are worked out when it is read) is timed apart,
   after the batch: a server does it as it answers, in the handler.
2. One request pre-fills a 512-token prompt alone, untraced and traced, in back-to-back pairs
   (a new prompt each time: no prefix-cache hit): the traced pre-fill's time (attention and lens
   kept in flight) over the untraced, and the same with the traced request's analysis pass added.
3. One click in the explorer: `inspect_position` (attention rows at every layer and head, and the
   logit lens) of a token 512 positions in, after its text was generated (prefix cache warm).

The model runs on the default path (int4; `--dtype float32`: the reference).

    .venv/bin/python benchmarks/trace_overhead.py [--batch 16] [--tokens 32] [--repeats 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import save, summarize

from pellucid import LLM, SamplingParams
from pellucid.engine import TraceOptions
from pellucid.probing import inspect_position

TOPICS = [
    "the sea",
    "a city",
    "music",
    "the moon",
    "bread",
    "rivers",
    "trains",
    "winter",
    "a garden",
    "books",
    "the desert",
    "clocks",
    "birds",
    "mountains",
    "coffee",
    "rain",
]


@dataclass
class Run:
    wall_s: float  # the whole batch's wall time
    wall_tok_s: float  # the untraced requests' tokens per second of wall time
    cpu_tok_s: float  # ... per second of this process's CPU time (less hurt by busy neighbours)
    recording_s: float  # time the traced request's recorder spent inside the steps
    steps_s: float  # time of the steps the traced request was in
    analysis_s: float  # its pass for attention and lens, once it was done
    read_s: float  # reading its trace, after the batch: stages and the lens worked out then
    step_s: list[float]  # each engine step's time, in order


def run_batch(
    llm: LLM, prompts: list[list[int]], tokens: int, trace_one: bool, trace: bool | TraceOptions
) -> Run:
    plain = SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        seed=0,
        max_tokens=tokens,
        ignore_eos=True,
    )
    first = replace(plain, max_tokens=tokens // 2, trace=trace if trace_one else False)
    seqs = [llm.engine.add_request(p, first if i == 0 else plain) for i, p in enumerate(prompts)]
    steps_s = []
    wall, cpu = time.perf_counter(), time.process_time()
    while llm.engine.has_unfinished():
        start = time.perf_counter()
        llm.engine.step()
        steps_s.append(time.perf_counter() - start)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = sum(len(s.output_ids) for s in seqs[1:])
    read = time.perf_counter()
    t = seqs[0].trace.trace if trace_one else None
    read = time.perf_counter() - read
    steps = t.steps if t is not None else []
    return Run(
        wall,
        done / wall,
        done / cpu,
        sum(s.trace_seconds for s in steps),
        sum(s.seconds + s.trace_seconds for s in steps),
        t.analysis_seconds if t is not None else 0.0,
        read,
        steps_s,
    )


def by_step(runs: list[Run]) -> float:
    """A batch's time as the sum over its steps of each step's median across `runs`: the
    same steps run in every repeat, so a burst of noise moves one repeat's step, not the sum."""
    n = max(len(r.step_s) for r in runs)
    return sum(statistics.median(r.step_s[k] for r in runs if k < len(r.step_s)) for k in range(n))


def prefill_s(llm: LLM, ids: list[int], trace: bool | TraceOptions) -> tuple[float, float]:
    """Seconds the engine spent pre-filling `ids` (one request, alone), and in the analysis
    pass of its trace."""
    seq = llm.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, trace=trace))
    while llm.engine.has_unfinished():
        llm.engine.step()
    return seq.timings.prefill_s, seq.trace.trace.analysis_seconds if seq.trace else 0.0


def prompt_of(llm: LLM, n: int, salt: int) -> list[int]:
    """n token ids of ordinary text, starting with a number no earlier prompt had."""
    text = (Path(__file__).parent / "prompt.txt").read_text()
    return llm.encode(f"{salt}. {text}")[:n]


def prefill_pairs(
    llm: LLM, trace: bool | TraceOptions, repeats: int
) -> list[tuple[float, float, float]]:
    """(untraced pre-fill, traced pre-fill, its analysis pass) seconds, `repeats` times."""
    prefill_s(llm, prompt_of(llm, 512, -1), trace)  # warm-up
    pairs = []
    for i in range(repeats):
        plain, _ = prefill_s(llm, prompt_of(llm, 512, 2 * i), False)
        pairs.append((plain, *prefill_s(llm, prompt_of(llm, 512, 2 * i + 1), trace)))
    return pairs


def inspect_s(llm: LLM, repeats: int) -> list[float]:
    """Seconds of one explorer click on the last of 512 tokens just generated over."""
    ids = prompt_of(llm, 512, 10_000)
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=1))  # its KV, as a reply leaves it
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        inspect_position(llm, ids, len(ids) - 1)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtype", default="int4", help="int4 (the default path) or float32")
    ap.add_argument("--basic", action="store_true", help="trace without attention and lens")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype)
    layers = list(range(llm.model.cfg.n_layers))
    trace = True if args.basic else TraceOptions(attention_layers=layers, logit_lens=True)
    what = "tokens, stage top-k, timings, KV" + ("" if args.basic else ", attention, logit lens")
    prompts = [
        llm.encode(f"Write a short poem about {TOPICS[i % len(TOPICS)]}.")
        for i in range(args.batch)
    ]
    run_batch(llm, prompts, args.tokens, False, trace)  # warm-up: both paths, full length
    run_batch(llm, prompts, args.tokens, True, trace)
    pairs = []
    for i in range(args.repeats):  # back-to-back pairs: a busy moment hits both sides alike
        # in turn first and second, so a machine slowing down (or warming) favours neither
        first, second = (False, True) if i % 2 == 0 else (True, False)
        runs = {t: run_batch(llm, prompts, args.tokens, t, trace) for t in (first, second)}
        pairs.append((runs[False], runs[True]))
    prefills = prefill_pairs(llm, trace, args.repeats)
    prefill_ratio = statistics.median(t / p for p, t, _ in prefills)
    with_pass = statistics.median((t + a) / p for p, t, a in prefills)
    clicks = inspect_s(llm, args.repeats)
    wall = 1 - statistics.median(t.wall_tok_s / p.wall_tok_s for p, t in pairs)
    cpu = 1 - statistics.median(t.cpu_tok_s / p.cpu_tok_s for p, t in pairs)
    # the same untraced tokens in both: tokens/s lost = 1 - plain time / traced time
    steps = 1 - by_step([p for p, _ in pairs]) / by_step([t for _, t in pairs])
    share = sum(t.recording_s for _, t in pairs) / sum(t.steps_s for _, t in pairs)
    # the engine runs one thing at a time: the trace's own work (recording in the steps, the
    # analysis pass) is time the batch waits, whatever the machine's noise does to the pairs
    own = statistics.median(
        (t.recording_s + t.analysis_s) / (p.wall_s + t.recording_s + t.analysis_s) for p, t in pairs
    )
    print(
        f"{args.batch - 1} untraced requests next to one traced request, median paired cost: "
        f"{wall:+.1%} tokens/s of wall time, {cpu:+.1%} tokens/s of CPU time; by each step's "
        f"median: {steps:+.1%}; the trace's "
        f"own work (recording in the steps and the analysis pass) {own:.1%} of the batch's "
        f"wall time; recording "
        f"took {share:.2%} of the steps the traced request shared, its analysis pass "
        f"{statistics.median(t.analysis_s for _, t in pairs) * 1000:.0f} ms (median); reading "
        f"the trace after the batch (sampling stages and logit lens worked out then) "
        f"{statistics.median(t.read_s for _, t in pairs) * 1000:.0f} ms"
    )
    print(
        f"its own 512-token pre-fill traced / untraced: median {prefill_ratio:.2f}x "
        f"({', '.join(f'{t / p:.2f}' for p, t, _ in prefills)}); with its analysis pass: "
        f"{with_pass:.2f}x; one explorer click (attention "
        f"and lens of position 511): median {statistics.median(clicks) * 1000:.0f} ms "
        f"(min {min(clicks) * 1000:.0f}, max {max(clicks) * 1000:.0f})"
    )
    save(
        "trace_overhead-basic" if args.basic else "trace_overhead",
        {
            "model": args.model,
            "dtype": args.dtype,
            "workload": f"{args.batch} requests x {args.tokens} sampled tokens (request 0: "
            f"{args.tokens // 2}), request 0 traced or not ({what})",
            "pairs": [{"plain": asdict(p), "traced": asdict(t)} for p, t in pairs],
            "median_paired_cost_wall": round(wall, 4),
            "median_paired_cost_cpu": round(cpu, 4),
            "cost_by_step_medians": round(steps, 4),
            "recording_share_of_steps": round(share, 5),
            "trace_work_share_of_batch_median": round(own, 4),
            "prefill_512_pairs_s": [
                {"plain": p, "traced": t, "analysis": a} for p, t, a in prefills
            ],
            "prefill_traced_over_plain_median": round(prefill_ratio, 3),
            "prefill_and_analysis_over_plain_median": round(with_pass, 3),
            "inspect_position_511_s": summarize(clicks),
        },
    )


if __name__ == "__main__":
    main()
