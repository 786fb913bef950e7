"""Weights onto a 4- or 5-bit grid, group by group: the integers, scales and minimums that the
int4 and int5 layouts pack (models/quant.py).

Each group of GROUP weights along the input maps its min..max onto 0..15 (0..31 with 5 bits),
w ~ q * scale + min: for a Q4_1 file's weights this gives back the file's own integers. A Q4_0
or Q4_K file's lie on a 4-bit grid too (Q5_0's and Q5_K's on a 5-bit one), but their integers
need not reach both ends of it (Q4_K sets each sub-block's scale and min from its
super-block's, Q4_0 fixes the zero at 8, Q5_0 at 16), and min..max onto 0..15 then moves them by
several percent (benchmarks/results/comments.md), enough that the matrix went to int8. So where
min..max errs, the grid each group does lie on is looked for (best_steps).
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # weights sharing one scale and zero (Q4_1's block size)
SAMPLE_ROWS = 64  # rows whose groups tell whether a matrix lies on a 4-bit grid
ON_GRID = 1e-3  # relative error below which weights are taken to lie on the grid found


def quantize_groups(w: Tensor, bits: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """(out, in) float32 weights, group by group along the input, each group's min..max mapped
    onto 0..levels (2**bits - 1): q (out, in) in 0..levels, and each group's scale and min
    (out, in/GROUP), so that w ~ q * scale + min; unless that errs where fewer steps would not
    (the module's docstring). Whether a matrix lies on such a grid is read from its first
    SAMPLE_ROWS rows: a search of the whole costs a pass per step count, for nothing where there
    is no grid (Q6_K; Q5_0 with 4 bits)."""
    out_f, in_f = w.shape
    levels = 2**bits - 1
    groups = w.view(out_f, in_f // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    q, scale = onto_steps(groups, low, high, levels, levels)
    part = slice(0, SAMPLE_ROWS)
    if grid_error(groups[part], q[part], scale[part], low[part]) > ON_GRID:
        fewer = best_steps(groups[part], low[part], high[part], levels)
        if grid_error(groups[part], *fewer, low[part]) <= ON_GRID:
            q, scale = best_steps(groups, low, high, levels)
    return q.view(out_f, in_f), scale, low


def onto_steps(
    groups: Tensor, low: Tensor, high: Tensor, steps: int, levels: int = 15
) -> tuple[Tensor, Tensor]:
    """(out, in/GROUP, GROUP) groups onto `steps` equal steps from each one's min to its max:
    the integers q (0..steps, float; clamped to 0..levels) and each group's step
    (out, in/GROUP)."""
    scale = ((high - low) / steps).clamp(min=1e-12)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, levels)
    return q, scale


def squared_error(groups: Tensor, q: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """Each group's summed squared error of q * scale + low: (out, in/GROUP)."""
    return (q * scale[..., None] + low[..., None] - groups).pow(2).sum(-1)


def grid_error(groups: Tensor, q: Tensor, scale: Tensor, low: Tensor) -> float:
    """Relative (Frobenius) error of q * scale + low against the groups."""
    err = squared_error(groups, q, scale, low).sum().sqrt()
    return (err / groups.norm().clamp(min=1e-12)).item()


def best_steps(
    groups: Tensor, low: Tensor, high: Tensor, levels: int = 15
) -> tuple[Tensor, Tensor]:
    """Each group onto levels, levels - 1, ... 1 steps from its min to its max, whichever
    reproduces it best (ties to more steps): q and scale as onto_steps'."""
    q, scale = onto_steps(groups, low, high, levels, levels)
    least = squared_error(groups, q, scale, low)
    for steps in range(levels - 1, 0, -1):
        q_s, scale_s = onto_steps(groups, low, high, steps, levels)
        err = squared_error(groups, q_s, scale_s, low)
        better = err < least
        least = torch.where(better, err, least)
        q, scale = torch.where(better[..., None], q_s, q), torch.where(better, scale_s, scale)
    return q, scale
