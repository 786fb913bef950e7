"""What a decode step costs by its rows and their context: the measurements behind the drafter's
cost model (engine/drafter.py: ROW_COST, WIDE_ROW_COST, ATTEND_COST, GUESS_ATTEND), and a
least-squares fit of that model to them, to compare with the constants in the code.

    .venv/bin/python benchmarks/step_cost.py [--model smollm2-135m] [--repeats 15]

Each step is the default fast path's compiled decode step (LLM()), for the rows of one
sequence (a token and its guesses, as a drafted step has them) at 64 to 2,048 tokens of
context, the keys and values filled with random numbers first (an untouched pool is zero
pages, which every read would find in cache). The kinds take turns within each repeat. Times
are the step's forward pass (LM head included), in ms; the model is fitted to the medians:
    t(rows, context) = t0 * (1 + ROW_COST * (min(rows, 4) - 1) + WIDE_ROW_COST * max(rows - 4, 0)
                             + ATTEND_COST * context * (1 + GUESS_ATTEND * (rows - 1)))
(the first row is the sequence's, the others its guesses)
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import torch
from common import save, summarize

from pellucid import LLM
from pellucid.engine import drafter
from pellucid.engine.model_runner import _decode_batch
from pellucid.models.context import ForwardContext

CONTEXTS = (64, 512, 1024, 2048)
ROWS = (1, 2, 3, 4, 6, 8)


def step(llm: LLM, rows: int, context: int) -> float:
    """Seconds of one decode step of `rows` rows of one sequence ending at `context` tokens."""
    runner = llm.engine.model_runner
    bs = runner.pool.block_size
    table = list(range(1, -(-context // bs) + 1))  # block 0 is the engine's filler
    positions = torch.arange(context - rows, context)
    slots = torch.tensor(table)[positions // bs] * bs + positions % bs
    lens = (positions + 1).tolist()
    decode = _decode_batch(list(range(rows)), [table] * rows, lens, bs)
    ctx = ForwardContext(runner.pool.k, runner.pool.v, slots, [], decode)
    ids = torch.zeros(rows, dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode():
        runner.logits(ids, positions, ctx, list(range(rows)), whole_graph=True)
    return time.perf_counter() - start


def fit(medians: dict[tuple[int, int], float]) -> dict[str, float]:
    """The drafter's cost model fitted to the medians (least squares): t0 in ms and the
    constants in units of it."""
    keys = list(medians)
    few = drafter.FEW_ROWS
    a = torch.tensor(
        [[1, min(r, few) - 1, max(r - few, 0), c, c * (r - 1)] for r, c in keys],
        dtype=torch.float64,
    )
    b = torch.tensor([medians[k] for k in keys], dtype=torch.float64)[:, None]
    t0, row, wide, attend, guess = torch.linalg.lstsq(a, b).solution[:, 0].tolist()
    return {
        "t0_ms": t0,
        "ROW_COST": row / t0,
        "WIDE_ROW_COST": wide / t0,
        "ATTEND_COST": attend / t0,
        "GUESS_ATTEND": guess / attend,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    llm = LLM(args.model)
    pool = llm.engine.model_runner.pool
    used = -(-max(CONTEXTS) // pool.block_size) + 1
    torch.manual_seed(0)
    for cache in (*pool.k, *pool.v):
        cache[:used] = torch.randn(cache[:used].shape).to(cache.dtype)
    kinds = [(r, c) for c in CONTEXTS for r in ROWS]
    for r, c in kinds:  # warm: every kind once (the many-rows package is loaded at first use)
        step(llm, r, c)
    times: dict[tuple[int, int], list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for r, c in kinds:
            times[r, c].append(step(llm, r, c) * 1e3)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"decode step (ms, medians of {args.repeats}) by rows (columns) and context (lines)")
    print("context " + "".join(f"{r:>9}" for r in ROWS))
    for c in CONTEXTS:
        print(f"{c:>7} " + "".join(f"{medians[r, c]:>9.2f}" for r in ROWS))
    fitted = fit(medians)
    names = ("ROW_COST", "WIDE_ROW_COST", "ATTEND_COST", "GUESS_ATTEND")
    code = {n: getattr(drafter, n) for n in names}
    print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.items()))
    print("in the code: " + ", ".join(f"{k} {v:.4g}" for k, v in code.items()))
    result = {
        "model": args.model,
        "step_ms": {f"{r} rows at {c}": summarize(times[r, c]) for r, c in kinds},
        "fitted": fitted,
        "drafter": code,
    }
    save("step_cost", result)


if __name__ == "__main__":
    main()
