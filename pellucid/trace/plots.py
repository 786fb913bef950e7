"""PNG plots of an Explanation with matplotlib (no display needed): attention heatmaps, per-step
timing, KV cache growth, next-token probabilities, and the no-cache and training experiments.

    write_plots(ex, "plots/")  ->  [plots/attention.png, plots/timing.png, ...]
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no window, works on a headless machine

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from pellucid.engine.trace_records import Trace
from pellucid.trace.records import Explanation

MAX_PROB_STEPS = 8  # steps drawn in probabilities.png


def write_plots(ex: Explanation, folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures = {
        "attention": attention(ex),
        "attention_heads": attention_heads(ex),
        "timing": timing(ex.trace),
        "kv_cache": kv_growth(ex.trace),
        "probabilities": probabilities(ex.trace),
        "stages": stages(ex.trace),
    }
    if ex.no_cache is not None:
        figures["no_cache"] = no_cache(ex)
    if ex.training is not None:
        figures["training"] = training(ex)
    paths = []
    for name, fig in figures.items():
        if fig is None:
            continue
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _labels(t: Trace) -> list[str]:
    return [tok.piece.replace("\n", "\\n") for tok in t.tokenization.tokens]


def _matrix(ex: Explanation, head: int) -> list[list[float]] | None:
    amap = ex.trace.attention_for(ex.layer)
    if amap is None or head not in amap.heads:
        return None
    return amap.prompt[amap.heads.index(head)]


def attention(ex: Explanation) -> Figure | None:
    matrix = _matrix(ex, ex.head)
    if matrix is None:
        return None
    labels = _labels(ex.trace)
    size = 2 + 0.45 * len(labels)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(matrix, cmap="Oranges", vmin=0, vmax=1)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("key (looked at)")
    ax.set_ylabel("query (looking)")
    ax.set_title(f"Attention, layer {ex.layer} head {ex.head}: softmax(Q·Kᵀ/√d)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    return fig


def attention_heads(ex: Explanation) -> Figure | None:
    amap = ex.trace.attention_for(ex.layer)
    if amap is None:
        return None
    n = len(amap.heads)
    cols = min(n, 5)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, head, matrix in zip(axes.flat, amap.heads, amap.prompt):
        ax.imshow(matrix, cmap="Oranges", vmin=0, vmax=1)
        ax.set_title(f"head {head}", fontsize=9)
    fig.suptitle(f"Every head of layer {ex.layer} over the prompt")
    return fig


def timing(t: Trace) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 3))
    chunks = [c.seconds * 1000 for c in t.prefill.chunks]
    decode = [s.seconds * 1000 for s in t.decode_steps]
    ax.bar(range(len(chunks)), chunks, color="#f08c00", label="pre-fill (whole prompt)")
    ax.bar(
        range(len(chunks), len(chunks) + len(decode)),
        decode,
        color="#4c6ef5",
        label="decode (one token)",
    )
    ax.set_xlabel("forward pass")
    ax.set_ylabel("ms")
    ax.set_title(
        f"Time per step: pre-fill {t.prefill.prompt_tokens} tokens at once, then one token per step"
    )
    ax.legend()
    return fig


def kv_growth(t: Trace) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3))
    steps = [s.index for s in t.steps]
    kib = [s.context_tokens * t.kv.bytes_per_token / 1024 for s in t.steps]
    allocated = [s.kv_blocks * t.kv.block_size * t.kv.bytes_per_token / 1024 for s in t.steps]
    ax.plot(steps, kib, marker="o", color="#12b886", label="K/V held")
    ax.step(
        steps,
        allocated,
        where="post",
        color="#868e96",
        linestyle="--",
        label=f"blocks allocated ({t.kv.block_size} tokens each)",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("KiB")
    ax.set_title(f"KV cache growth: {t.kv.bytes_per_token:,} bytes per token")
    ax.legend()
    return fig


def probabilities(t: Trace) -> Figure | None:
    steps = t.steps[:MAX_PROB_STEPS]
    if not steps:
        return None
    fig, axes = plt.subplots(1, len(steps), figsize=(2.4 * len(steps), 3), squeeze=False)
    for ax, s in zip(axes[0], steps):
        top = s.stages[0].top  # the raw model distribution
        names = [repr(c.piece) for c in top][::-1]
        colors = ["#d9480f" if c.id == s.token.id else "#adb5bd" for c in top][::-1]
        ax.barh(names, [c.prob for c in top][::-1], color=colors)
        ax.set_xlim(0, 1)
        ax.set_title(f"step {s.index}", fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle("Next-token probabilities (raw model; chosen token in orange)")
    fig.tight_layout()
    return fig


def stages(t: Trace) -> Figure | None:
    if not t.steps:
        return None
    step = t.steps[0]
    fig, axes = plt.subplots(
        1, len(step.stages), figsize=(2.4 * len(step.stages), 3), squeeze=False
    )
    for ax, st in zip(axes[0], step.stages):
        ax.barh(
            [repr(c.piece) for c in st.top][::-1], [c.prob for c in st.top][::-1], color="#4c6ef5"
        )
        ax.set_xlim(0, 1)
        ax.set_title(f"{st.name}\n{st.kept:,} left", fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"Sampling stages of the first token ({step.token.piece!r})")
    fig.tight_layout()
    return fig


def no_cache(ex: Explanation) -> Figure:
    c = ex.no_cache
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["with KV cache", "without"], [c.cached_s, c.uncached_s], color=["#12b886", "#fa5252"])
    ax.set_ylabel("seconds")
    ax.set_title(f"{c.tokens} tokens: {c.slowdown:.1f}× slower without the cache")
    return fig


def training(ex: Explanation) -> Figure:
    w = ex.training
    fig, ax = plt.subplots(figsize=(5, 3))
    losses = [s.loss for s in w.steps] + [w.final_loss]
    ax.plot(range(len(losses)), losses, marker="o")
    ax.set_xlabel("gradient step")
    ax.set_ylabel("loss")
    ax.set_title("Training: loss falls as the weights are updated")
    return fig
