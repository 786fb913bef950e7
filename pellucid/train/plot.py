"""The loss curve as a PNG: training loss every step, validation loss at each evaluation."""

from __future__ import annotations

from pathlib import Path

from pellucid.atomic import atomic_path


def plot_losses(history: dict[str, list], path: Path, title: str = "") -> Path | None:
    """Write the curve to `path`; None when matplotlib is missing (pip install 'pellucid[train]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, lw=0.8, alpha=0.6, label="train (per step)")
    if history["val"]:
        steps, losses = zip(*history["val"])
        ax.plot(steps, losses, "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return path
