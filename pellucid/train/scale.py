"""Scaling sweep: train several model sizes for several token budgets, fit loss = a · C^(-alpha).

C is training compute in FLOPs (6 · parameters · tokens, plus attention). For each compute level the
best loss any size reached forms the compute-efficient frontier; a straight line through it in
log-log space is the power law (Kaplan et al. 2020, L(C_min)). R² says how well it fits. A second
line fits loss against parameters N at the largest token budget: loss = b · N^(-beta).

    pellucid scale --data data/shakespeare_char --out runs/scale
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pellucid.train.config import TrainConfig
from pellucid.train.flops import flops_per_token, n_params
from pellucid.train.trainer import Trainer

# (n_layers, n_heads, dim): 0.01M to 0.8M parameters plus embeddings, each about 2x the last.
SIZES = ((1, 2, 32), (2, 2, 48), (2, 4, 64), (3, 4, 96), (4, 4, 128))
ITERS = (250, 500, 1000)  # token budgets: iterations of batch_size x block_size tokens


@dataclass(frozen=True, slots=True)
class ScaleRun:
    name: str
    n_layers: int
    dim: int
    params: int
    tokens: int
    compute: float  # training FLOPs
    val_loss: float
    seconds: float


@dataclass(frozen=True, slots=True)
class PowerLaw:
    a: float
    alpha: float  # loss = a * x ** -alpha, x the compute C (or the parameters N)
    r2: float  # of log loss against log x, over the runs fitted
    fitted: list[str]  # names of the runs it was fitted to (for C: the frontier)

    def loss_at(self, x: float) -> float:
        return self.a * x**-self.alpha


def run_sweep(base: TrainConfig, out: Path, sizes=SIZES, iters=ITERS, log=print) -> list[ScaleRun]:
    runs = []
    for n_layers, n_heads, dim in sizes:
        for n in iters:
            name = f"L{n_layers}-d{dim}-i{n}"
            cfg = replace(
                base,
                out=str(out / name),
                n_layers=n_layers,
                n_heads=n_heads,
                dim=dim,
                max_iters=n,
                lr_decay_iters=None,
                warmup_iters=min(100, n // 10),
                eval_interval=n,
                ckpt_interval=0,
            )
            start = time.perf_counter()
            trainer = Trainer(cfg, verbose=False)
            trainer.run()
            loss = trainer.full_loss("val")
            tokens = n * cfg.tokens_per_iter
            mc = trainer.model_cfg
            runs.append(
                ScaleRun(
                    name,
                    n_layers,
                    dim,
                    n_params(mc),
                    tokens,
                    float(flops_per_token(mc, cfg.block_size) * tokens),
                    loss,
                    time.perf_counter() - start,
                )
            )
            log(
                f"{name}: {runs[-1].params / 1e6:.3f}M params, {tokens:,} tokens, "
                f"C={runs[-1].compute:.2e} FLOPs, val loss {loss:.4f} ({runs[-1].seconds:.0f} s)"
            )
    return runs


def frontier(runs: list[ScaleRun]) -> list[ScaleRun]:
    """Runs that beat every run of less compute: the best loss reachable at each budget."""
    best, out = math.inf, []
    for run in sorted(runs, key=lambda r: r.compute):
        if run.val_loss < best:
            best = run.val_loss
            out.append(run)
    return out


def fit_power_law(runs: list[ScaleRun]) -> PowerLaw:
    """loss = a · C^-alpha over the compute frontier."""
    points = frontier(runs)
    if len(points) < 3:
        raise ValueError(f"only {len(points)} runs on the frontier; a fit needs at least 3")
    return fit_log_line([(r.compute, r.val_loss) for r in points], [r.name for r in points])


def fit_params_law(runs: list[ScaleRun]) -> PowerLaw:
    """loss = b · N^-beta over the model sizes, each trained on the largest token budget."""
    most = max(r.tokens for r in runs)
    points = sorted((r for r in runs if r.tokens == most), key=lambda r: r.params)
    if len({r.params for r in points}) < 3:
        raise ValueError("a fit against parameters needs at least 3 sizes at the largest budget")
    return fit_log_line([(r.params, r.val_loss) for r in points], [r.name for r in points])


def fit_log_line(points: list[tuple[float, float]], names: list[str]) -> PowerLaw:
    """Least squares of log(y) = log(a) - alpha · log(x)."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return PowerLaw(math.exp(intercept), -slope, r2, names)


def report(runs: list[ScaleRun], law: PowerLaw, params_law: PowerLaw, out: Path) -> str:
    """Write scale.json and scale.png; return the table as text."""
    out.mkdir(parents=True, exist_ok=True)
    fits = {"fit": asdict(law), "fit_params": asdict(params_law)}
    (out / "scale.json").write_text(
        json.dumps({"runs": [asdict(r) for r in runs], **fits}, indent=1) + "\n"
    )
    plot_scaling(runs, law, params_law, out / "scale.png")
    lines = [f"{'run':16s}{'params':>10s}{'tokens':>11s}{'FLOPs':>11s}{'val loss':>10s}  frontier"]
    for r in sorted(runs, key=lambda r: r.compute):
        mark = "*" if r.name in law.fitted else ""
        lines.append(
            f"{r.name:16s}{r.params:>10,}{r.tokens:>11,}{r.compute:>11.2e}"
            f"{r.val_loss:>10.4f}  {mark}"
        )
    lines.append(
        f"fit over the frontier: loss = {law.a:.3g} * C^-{law.alpha:.4f}, R² = {law.r2:.3f}"
    )
    lines.append(
        f"fit over the sizes at {max(r.tokens for r in runs):,} tokens: loss = "
        f"{params_law.a:.3g} * N^-{params_law.alpha:.4f}, R² = {params_law.r2:.3f}"
    )
    return "\n".join(lines)


def plot_scaling(
    runs: list[ScaleRun], law: PowerLaw, params_law: PowerLaw, path: Path
) -> Path | None:
    """Left: loss against compute, one line per size, and the frontier's fit. Right: loss against
    parameters at the largest budget, and its fit."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, NullFormatter
    except ImportError:
        return None
    fig, (by_c, by_n) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for size in sorted({(r.n_layers, r.dim) for r in runs}):
        group = sorted((r for r in runs if (r.n_layers, r.dim) == size), key=lambda r: r.compute)
        by_c.plot(
            [r.compute for r in group],
            [r.val_loss for r in group],
            "o-",
            label=f"{group[0].params / 1e6:.2f}M params",
        )
    plot_fit(by_c, law, [r.compute for r in runs], "C")
    by_c.set_xlabel("training compute C (FLOPs)")
    largest = sorted((r for r in runs if r.name in params_law.fitted), key=lambda r: r.params)
    by_n.plot(
        [r.params for r in largest],
        [r.val_loss for r in largest],
        "o",
        label=f"{largest[0].tokens:,} tokens each",
    )
    plot_fit(by_n, params_law, [r.params for r in largest], "N")
    by_n.set_xlabel("parameters N")
    for ax in (by_c, by_n):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labels at the powers of ten only
        for axis in ("major", "minor"):  # losses as plain numbers, not 2x10^0
            getattr(ax.yaxis, f"set_{axis}_formatter")(FormatStrFormatter("%.1f"))
        ax.set_ylabel("val loss (nats/token)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_fit(ax, law: PowerLaw, xs: list[float], name: str) -> None:
    """The fitted power law as a dashed line across the x range of the points."""
    lo, hi = min(xs), max(xs)
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.plot(
        grid,
        [law.loss_at(x) for x in grid],
        "k--",
        label=f"{law.a:.3g}·{name}^-{law.alpha:.3f} (R² {law.r2:.3f})",
    )
