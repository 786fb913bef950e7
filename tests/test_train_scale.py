"""Scaling sweep: the frontier, the power-law fit and a miniature sweep end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_text

from pellucid.train.data import prepare
from pellucid.train.scale import (
    ScaleRun,
    fit_params_law,
    fit_power_law,
    frontier,
    report,
    run_sweep,
)


def run(name: str, compute: float, loss: float) -> ScaleRun:
    return ScaleRun(name, 1, 8, 100, 1000, compute, loss, 0.0)


def test_fit_recovers_an_exact_power_law():
    runs = [run(f"r{i}", c, 20.0 * c**-0.1) for i, c in enumerate([1e9, 1e10, 1e11, 1e12])]
    runs.append(run("worse", 1e11, 5.0))  # off the frontier: ignored by the fit
    law = fit_power_law(runs)
    assert law.alpha == pytest.approx(0.1) and law.a == pytest.approx(20.0)
    assert law.r2 == pytest.approx(1.0) and "worse" not in law.fitted


def test_params_fit_uses_the_largest_budget():
    def sized(name: str, params: int, tokens: int, loss: float) -> ScaleRun:
        return ScaleRun(name, 1, 8, params, tokens, 6.0 * params * tokens, loss, 0.0)

    runs = [sized(f"n{n}", n, 4000, 30.0 * n**-0.2) for n in (10**3, 10**4, 10**5)]
    runs.append(sized("short", 10**5, 1000, 9.0))  # a smaller budget: not in this fit
    law = fit_params_law(runs)
    assert law.alpha == pytest.approx(0.2) and law.a == pytest.approx(30.0)
    assert law.r2 == pytest.approx(1.0) and law.fitted == ["n1000", "n10000", "n100000"]
    with pytest.raises(ValueError, match="3 sizes"):
        fit_params_law(runs[1:])


def test_frontier_keeps_only_improvements():
    runs = [run("a", 1, 3.0), run("b", 2, 3.5), run("c", 3, 2.5), run("d", 4, 2.6)]
    assert [r.name for r in frontier(runs)] == ["a", "c"]
    with pytest.raises(ValueError, match="at least 3"):
        fit_power_law(runs)


def test_miniature_sweep(tmp_path: Path):
    threads = torch.get_num_threads()
    (tmp_path / "t.txt").write_text(tiny_text())
    prepare([str(tmp_path / "t.txt")], "char", tmp_path / "data")
    base = tiny_config(tmp_path / "data", tmp_path / "scale")
    try:
        runs = run_sweep(
            base,
            tmp_path / "runs",
            sizes=((1, 2, 16), (2, 2, 32)),
            iters=(10, 20),
            log=lambda line: None,
        )
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 4 and all(r.val_loss > 0 for r in runs)
    assert runs[1].compute == pytest.approx(2 * runs[0].compute)
    sizes = runs + [run("tiny", 1.0, 9.0)]
    sizes = sizes + [ScaleRun("big", 3, 64, 10**6, runs[-1].tokens, 1e12, 1.0, 0.0)]
    table = report(runs, fit_power_law(sizes), fit_params_law(sizes), tmp_path)
    assert "N^-" in table and "R² =" in table and (tmp_path / "scale.json").is_file()
