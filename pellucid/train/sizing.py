"""How big a model a compute budget buys: IsoFLOP profiles (Hoffmann et al. 2022, "Chinchilla",
approach 2), fitted on the data the model will train on.

For a few small budgets C, each of a few sizes N trains on exactly C FLOPs (so the smaller ones
see more tokens); the loss against log N is a valley, and its bottom is the best size for that C.
A line through those bottoms in log-log space, N_opt = k · C^a, extends to the real budget; the
family member (a depth: `family`) nearest that N is the model. C is measured in this machine's
FLOPs per second times the minutes given, so a faster machine gets a bigger model. Where the
sweep cannot find two bottoms (small budgets with a large vocabulary: even the smallest model
may be too big for them), Chinchilla's published law decides instead, 20 tokens a parameter.

    runs = isoflop_sweep(base, out, budgets=(C / 256, C / 128, C / 64))
    depth = choose_depth(fit_law(runs), seconds, vocab_size, runs)  # then family(base, depth)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pellucid.train.config import TrainConfig
from pellucid.train.data import TokenData
from pellucid.train.flops import flops_per_token, n_params
from pellucid.train.trainer import Trainer

DEPTHS = (1, 2, 3, 4)  # the sweep's sizes
MAX_DEPTH = 12  # the largest the speedrun may choose
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio: where no law can be fitted here


@dataclass(frozen=True, slots=True)
class SweepRun:
    depth: int
    params: int
    budget: float  # FLOPs it was given
    tokens: int
    val_loss: float
    flops_per_s: float  # this machine's training speed on it


@dataclass(frozen=True, slots=True)
class SizeLaw:
    k: float
    a: float  # N_opt = k · C^a
    optima: list[tuple[float, float]]  # (budget, best N) of each IsoFLOP profile
    note: str  # how the law was had: fitted, or fallen back on and why

    def size_at(self, compute: float) -> float:
        return self.k * compute**self.a


def family(base: TrainConfig, depth: int) -> TrainConfig:
    """The family, one number wide (nanochat's): `depth` layers of width 64 · depth, heads of 64."""
    return replace(base, n_layers=depth, n_heads=depth, dim=64 * depth)


def size_of(depth: int, vocab_size: int) -> int:
    return n_params(family(TrainConfig(data="", out=""), depth).model_config(vocab_size))


def step_flops(cfg: TrainConfig, vocab_size: int) -> float:
    """Training FLOPs of one step of `cfg` (6 a parameter a token, plus attention)."""
    return flops_per_token(cfg.model_config(vocab_size), cfg.block_size) * cfg.tokens_per_iter


def isoflop_sweep(
    base: TrainConfig, out: Path, budgets: tuple[float, ...], log=print
) -> list[SweepRun]:
    """Each depth of DEPTHS trained on each budget: max_iters = budget / FLOPs a step."""
    vocab_size = TokenData.open(base.data).vocab_size
    runs = []
    for budget in budgets:
        for depth in DEPTHS:
            cfg = family(base, depth)
            per_step = step_flops(cfg, vocab_size)
            iters = max(1, round(budget / per_step))
            cfg = replace(
                cfg,
                out=str(out / f"C{budget:.1e}-d{depth}"),
                max_iters=iters,
                lr_decay_iters=None,
                warmup_iters=iters // 10,
            )
            # the steps alone, then one validation: no evaluations or checkpoints on the way
            trainer = Trainer(cfg, verbose=False)
            start = time.perf_counter()
            for _ in range(iters):
                trainer.train_step()
            seconds = time.perf_counter() - start
            run = SweepRun(
                depth,
                n_params(trainer.model_cfg),
                budget,
                iters * cfg.tokens_per_iter,
                trainer.estimate_loss("val"),
                per_step * iters / seconds,
            )
            runs.append(run)
            log(
                f"C={budget:.2e}: depth {depth} ({run.params / 1e6:.2f}M params), "
                f"{run.tokens:,} tokens, val loss {run.val_loss:.4f}"
            )
    return runs


def profile_optimum(runs: list[SweepRun]) -> tuple[float, bool]:
    """The bottom of one budget's valley: the vertex of a parabola in log N when it opens up and
    lies among the sizes tried (True), else the best size tried (False)."""
    logs = np.log([r.params for r in runs])
    losses = np.array([r.val_loss for r in runs])
    best = float(np.exp(logs[losses.argmin()]))
    if len(runs) < 3:
        return best, False
    c2, c1, _ = np.polyfit(logs, losses, 2)
    vertex = -c1 / (2 * c2) if c2 > 0 else math.inf
    if not logs.min() <= vertex <= logs.max():
        return best, False
    return float(np.exp(vertex)), True


def fit_law(runs: list[SweepRun]) -> SizeLaw:
    """N_opt = k · C^a through the bottoms of the budgets' valleys (least squares in log-log),
    from the budgets whose bottom lies among the sizes tried. Where fewer than two do, or the
    line does not grow with C, Chinchilla's own law: 20 tokens a parameter."""
    optima, inside = [], []
    for budget in sorted({r.budget for r in runs}):
        size, interior = profile_optimum([r for r in runs if r.budget == budget])
        optima.append((budget, size))
        if interior:
            inside.append((budget, size))
    if len(inside) >= 2:
        a, log_k = np.polyfit(np.log([c for c, _ in inside]), np.log([n for _, n in inside]), 1)
        if 0 < a < 1:
            return SizeLaw(float(math.exp(log_k)), float(a), optima, "fitted")
        why = f"the line through the valleys' bottoms has exponent {a:.2f}, outside (0, 1)"
    else:
        why = (
            f"{len(inside)} of {len(optima)} valleys have their bottom among the sizes tried (the "
            "others' best size is the smallest or the largest: the bottom lies beyond)"
        )
    # C = 6 · N · D and D = 20 · N give N = (C / 120)^0.5
    law = f"Chinchilla's 20 tokens a parameter instead, N = (C / {6 * TOKENS_PER_PARAM})^0.5"
    return SizeLaw((6 * TOKENS_PER_PARAM) ** -0.5, 0.5, optima, f"{why}: {law}")


def choose_depth(law: SizeLaw, seconds: float, vocab_size: int, runs: list[SweepRun]) -> int:
    """The depth that is nearest (in ratio) to the size the law wants for the compute that depth
    itself gets done in `seconds` (a small model uses the cores less well: less compute), at
    most MAX_DEPTH."""

    def miss(depth: int) -> float:
        wanted = law.size_at(flops_per_s(runs, depth) * seconds)
        return abs(math.log(size_of(depth, vocab_size) / wanted))

    return min(range(1, MAX_DEPTH + 1), key=miss)


def flops_per_s(runs: list[SweepRun], depth: int) -> float:
    """This machine's training speed at `depth`, the median of its sweep runs; past the sweep's
    depths, its deepest's (a lower bound: wider matrices use the cores better)."""
    depth = min(depth, max(r.depth for r in runs))
    speeds = sorted(r.flops_per_s for r in runs if r.depth == depth)
    return speeds[len(speeds) // 2]


def plot_profiles(runs: list[SweepRun], law: SizeLaw, path: Path) -> Path | None:
    """Left: loss against parameters, one valley per budget, its bottom marked. Right: the
    bottoms against compute and the law through them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (valleys, line) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for budget, best in law.optima:
        group = sorted((r for r in runs if r.budget == budget), key=lambda r: r.params)
        drawn = valleys.plot([r.params for r in group], [r.val_loss for r in group], "o-")
        valleys.axvline(best, color=drawn[0].get_color(), ls=":", label=f"C = {budget:.1e}")
    valleys.set_xlabel("parameters N")
    valleys.set_ylabel("val loss (nats/token)")
    budgets = [c for c, _ in law.optima]
    line.plot(budgets, [n for _, n in law.optima], "o", label="each budget's best N")
    grid = [budgets[0] * (budgets[-1] / budgets[0]) ** (i / 20) for i in range(21)]
    line.plot(grid, [law.size_at(c) for c in grid], "k--", label=f"{law.k:.3g}·C^{law.a:.3f}")
    line.set_xlabel("training compute C (FLOPs)")
    line.set_ylabel("compute-optimal parameters")
    for ax in (valleys, line):
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    line.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
