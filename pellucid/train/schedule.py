"""The learning-rate schedule: linear warm-up, then cosine decay to min_lr (nanoGPT's `get_lr`)."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < warmup:  # ramp up from lr/(warmup+1): Adam's first steps see noisy moment estimates
        return lr * (step + 1) / (warmup + 1)
    if step >= decay_iters:  # at decay_iters the cosine has reached min_lr anyway
        return min_lr
    progress = (step - warmup) / (decay_iters - warmup)  # 0 -> 1 over the decay
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
