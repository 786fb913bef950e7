"""The terminal walk-through of an Explanation, in the order generation happens: tokenization ->
pre-fill -> attention -> KV cache -> the autoregressive loop -> final output (then the optional
no-cache comparison and training walk-through). Every number shown was measured on this run.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pellucid.engine.trace_records import Step, Trace
from pellucid.trace.records import Explanation, NoCacheComparison, TrainingWalk

HEATMAP_MAX = 16  # prompt tokens shown in the heatmap (the last ones)
LENS_EVERY = 5  # logit-lens layers shown: every 5th and the last


def render(ex: Explanation, console: Console) -> None:
    t = ex.trace
    m = t.model
    console.rule(
        f"[bold]pellucid explain[/] · {m.name} · {m.layers} layers, {m.heads} heads "
        f"({m.kv_heads} KV), d={m.dim}"
    )
    sections = [tokenization, prefill, attention, kv_cache, autoregressive, final_output]
    for number, section in enumerate(sections, 1):
        section(ex, console, number)
    extra = len(sections)
    if ex.no_cache is not None:
        extra += 1
        no_cache(ex.no_cache, console, extra)
    if ex.training is not None:
        training(ex.training, console, extra + 1)


def _title(console: Console, number: int, text: str) -> None:
    console.print()
    console.rule(f"[bold cyan]{number} · {text}", align="left")


def piece(p: str) -> Text:
    """A token as text, quoted, with newlines and tabs made visible (no markup parsed)."""
    return Text("'" + p.replace("\n", "\\n").replace("\t", "\\t") + "'")


def pct(p: float) -> str:
    return f"{p * 100:.1f}%" if p >= 0.001 else f"{p * 100:.2g}%"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# --- 1 · Tokenization -----------------------------------------------------------------------
def tokenization(ex: Explanation, console: Console, number: int) -> None:
    tokens = ex.trace.tokenization.tokens
    _title(console, number, f"Tokenization: the prompt becomes {len(tokens)} tokens")
    console.print(
        "The model never sees letters: each piece of text is looked up in a "
        f"vocabulary of {ex.trace.model.vocab_size:,} tokens and replaced by its id."
    )
    table = Table("#", "id", "piece", "")
    for i, tok in enumerate(tokens):
        table.add_row(str(i), str(tok.id), piece(tok.piece), "special" if tok.special else "")
    console.print(table)


# --- 2 · Pre-fill ---------------------------------------------------------------------------
def prefill(ex: Explanation, console: Console, number: int) -> None:
    t = ex.trace
    p = t.prefill
    _title(console, number, "Pre-fill: the whole prompt in parallel")
    computed = sum(c.tokens for c in p.chunks)
    console.print(
        f"{computed} prompt tokens went through all {t.model.layers} layers together in "
        f"{len(p.chunks)} forward pass{'es' if len(p.chunks) > 1 else ''}: "
        f"[bold]{ms(p.seconds)}[/], {p.tokens_per_s:,.0f} tokens/s."
    )
    if p.cached_tokens:
        console.print(
            f"{p.cached_tokens} more came from the prefix cache (computed by an "
            "earlier request with the same start), so their K/V were reused."
        )
    decode = t.forward_steps
    if decode:
        step_s = sum(s.seconds for s in decode) / len(decode)
        console.print(
            f"One decode step (1 token) took {ms(step_s)} on average: pre-fill handled "
            f"{computed} tokens in the time of {p.seconds / step_s:.1f} decode steps, "
            "because matrix multiplies over many rows cost little more than over one."
        )
    if t.steps:
        first = t.steps[0]
        console.print(
            Text.assemble(
                "The last prompt position already predicts the first new token: ",
                piece(first.token.piece),
                f" ({pct(first.token.prob)}).",
            )
        )


# --- 3 · Attention --------------------------------------------------------------------------
def attention(ex: Explanation, console: Console, number: int) -> None:
    t = ex.trace
    amap = t.attention_for(ex.layer)
    _title(console, number, f"Attention: layer {ex.layer}, head {ex.head}")
    m = t.model
    console.print(
        f"Every token makes a query Q (what am I looking for?), a key K (what do I "
        f"hold?) and a value V (what I pass on), {m.head_dim} numbers each per head. "
        f"softmax(Q·Kᵀ/√{m.head_dim}) weighs the earlier tokens; the weighted sum of "
        f"their V is what the token takes in. {m.heads} query heads share "
        f"{m.kv_heads} K/V heads here (grouped-query attention)."
    )
    if amap is None or ex.head not in amap.heads:
        console.print("[yellow]This layer/head was not traced.[/]")
        return
    matrix = amap.prompt[amap.heads.index(ex.head)]
    tokens = [tok.piece for tok in t.tokenization.tokens]
    console.print(heatmap(matrix, tokens))
    _focus_lines(console, matrix, tokens, ex.focus)
    if amap.steps:
        row = amap.steps[0][amap.heads.index(ex.head)]
        pieces = tokens + [s.token.piece for s in t.steps]
        console.print(
            Text.assemble(
                "At the first decode step the new query ",
                piece(pieces[len(row) - 1]),
                " looked at: ",
                _top_attended(row, pieces),
            )
        )


def heatmap(matrix: list[list[float]], tokens: list[str]) -> Table:
    """Rows: queries, columns: keys; each cell the weight in %, shaded by size."""
    start = max(0, len(tokens) - HEATMAP_MAX)
    shown = range(start, len(tokens))
    table = Table(box=None, padding=(0, 1, 0, 0), title="each row: where that token looks (%)")
    table.add_column("query \\ key", justify="right", no_wrap=True)
    for j in shown:
        label = tokens[j].replace("\n", "\\n").strip()[:5] or "·"
        table.add_column(Text(label), justify="right", min_width=5, no_wrap=True)
    for i in shown:
        cells = [_cell(matrix[i][j]) if j <= i else Text("") for j in shown]
        table.add_row(piece(tokens[i]), *cells)
    return table


def _cell(w: float) -> Text:
    level = int(40 + 215 * w**0.5)  # square root: small weights stay visible
    return Text(f"{w * 100:5.0f}", style=f"black on rgb({level},{level // 2},40)")


def _focus_lines(
    console: Console, matrix: list[list[float]], tokens: list[str], focus: int
) -> None:
    console.print(
        Text.assemble(
            piece(tokens[focus]), " looks at: ", _top_attended(matrix[focus][: focus + 1], tokens)
        )
    )
    later = [(matrix[i][focus], i) for i in range(focus + 1, len(tokens))]
    if later:
        parts = [Text.assemble(piece(tokens[i]), f" {pct(w)}") for w, i in sorted(later)[::-1][:3]]
        console.print(
            Text.assemble(piece(tokens[focus]), " is looked at by: ", Text(", ").join(parts))
        )
    console.print(
        "A token attends only to itself and earlier tokens (causal attention): words "
        "that come later read it, and carry its meaning forward.",
        style="dim",
    )


def _top_attended(row: list[float], tokens: list[str], n: int = 3) -> Text:
    best = sorted(range(len(row)), key=lambda j: -row[j])[:n]
    return Text(", ").join(Text.assemble(piece(tokens[j]), f" {pct(row[j])}") for j in best)


# --- 4 · KV cache ---------------------------------------------------------------------------
def kv_cache(ex: Explanation, console: Console, number: int) -> None:
    t, kv = ex.trace, ex.trace.kv
    _title(console, number, "KV cache: keys and values kept for reuse")
    console.print(
        f"Per token: 2 (K and V) × {kv.layers} layers × {kv.kv_heads} KV heads × "
        f"{kv.head_dim} numbers × {kv.dtype_bytes} bytes = "
        f"[bold]{kv.bytes_per_token:,} bytes[/] ({kv.bytes_per_token / 1024:.1f} KiB)."
    )
    if not t.steps:
        return
    last = t.steps[-1]
    console.print(
        f"After the last step: {last.context_tokens} tokens cached = "
        f"{last.context_tokens * kv.bytes_per_token / 1024:,.0f} KiB, in "
        f"{last.kv_blocks} block(s) of {kv.block_size} tokens "
        f"({t.prefill.cached_tokens} prompt tokens were prefix-cache hits)."
    )
    growth = " → ".join(str(s.context_tokens) for s in t.steps)
    console.print(f"Growth, tokens in the cache at each step: {growth}")
    T, n = t.prefill.prompt_tokens, len(t.steps)
    with_cache = T + n - 1
    without = sum(T + i for i in range(n))
    console.print(
        f"What it saved: each decode step pushed 1 new token through the model and read "
        f"the rest from the cache: {with_cache} token passes in all. Recomputing "
        f"everything each step would take {without} ({without / with_cache:.1f}× the "
        "work; --compare-no-cache measures it)."
    )


# --- 5 · The autoregressive loop ------------------------------------------------------------
def autoregressive(ex: Explanation, console: Console, number: int) -> None:
    t = ex.trace
    passes = len(t.forward_steps) + bool(t.steps)
    how = "one at a time" if passes == len(t.steps) else f"in {passes} forward passes"
    _title(console, number, f"The autoregressive loop: {len(t.steps)} tokens, {how}")
    table = Table("step", "token", "p", "near misses (raw model)", "time", "GB/s")
    drafting = any(s.draft for s in t.steps)
    if drafting:
        table.add_column("guesses checked in its pass (taken · refused)")
    for s in t.steps:
        misses = [c for c in s.stages[0].top if c.id != s.token.id][:3]
        row = [
            str(s.index) + (" (pre-fill)" if s.index == 0 else ""),
            piece(s.token.piece),
            pct(s.token.prob),
            Text(", ").join(Text.assemble(piece(c.piece), f" {pct(c.prob)}") for c in misses),
            ms(s.seconds) if s.drafted_in is None else f"in step {s.drafted_in}",
            f"{s.gb_per_s:.1f}" if s.drafted_in is None else "",
        ]
        table.add_row(*row, *([draft(s)] if drafting else []))
    console.print(table)
    if drafting:
        drafts_summary(t, console)
    if t.steps:
        stages(t.steps[0], console)
        lens(t.steps[0], console)
    bandwidth(t, console)


def draft(step: Step) -> Text:
    """A step's guesses: the ones the model agreed with in green, the first refused in red,
    the unchecked rest dim."""
    out = Text()
    for i, c in enumerate(step.draft):
        style = "green" if i < step.draft_taken else "red" if i == step.draft_taken else "dim"
        out.append(piece(c.piece).plain + " ", style=style)
    return out


def drafts_summary(t: Trace, console: Console) -> None:
    guessed = sum(len(s.draft) for s in t.steps)
    taken = sum(s.draft_taken for s in t.steps)
    console.print(
        f"Speculative decoding: the next tokens were guessed from n-grams already in the prompt "
        f"and reply, and checked in the same forward pass as the step's own token. {taken} of "
        f"{guessed} guesses were what the model would have chosen anyway: {taken} tokens "
        "came without a pass of their own. The first refused guess ends a draft; its K/V is "
        "overwritten by the next pass."
    )


def stages(step: Step, console: Console) -> None:
    console.print(
        Text.assemble(
            "How the first token ", piece(step.token.piece), " was chosen, stage by stage:"
        )
    )
    table = Table("stage", "tokens left", "top candidates")
    for st in step.stages:
        top = Text(", ").join(Text.assemble(piece(c.piece), f" {pct(c.prob)}") for c in st.top[:4])
        table.add_row(st.name, f"{st.kept:,}", top)
    console.print(table)


def lens(step: Step, console: Console) -> None:
    if not step.lens:
        return
    last = len(step.lens) - 1
    shown = [entry for entry in step.lens if entry.layer % LENS_EVERY == 0 or entry.layer == last]
    line = Text("Logit lens (the prediction read after layer n): ")
    line.append(
        Text(" · ").join(
            Text.assemble(f"{entry.layer}: ", piece(entry.top[0].piece))
            for entry in shown
            if entry.top
        )
    )
    console.print(line)


def bandwidth(t: Trace, console: Console) -> None:
    decode = t.forward_steps
    if not decode:
        return
    gbs = sum(s.gb_per_s for s in decode) / len(decode)
    mb = sum(s.bytes_moved for s in decode) / len(decode) / 1e6
    line = (
        f"Each decode step read every weight once ({t.model.weight_bytes / 1e6:,.0f} MB) "
        f"plus the cache: {mb:,.0f} MB at {gbs:.1f} GB/s on average"
    )
    if t.bandwidth_limit_gbs:
        share = gbs / t.bandwidth_limit_gbs
        line += (
            f", {share:.0%} of this machine's measured copy bandwidth "
            f"({t.bandwidth_limit_gbs:.1f} GB/s)"
        )
        line += (
            ": decoding is bound by memory traffic"
            if share > 0.5
            else ": well below it, so on this run compute and per-step overheads, not memory "
            "traffic, set the pace"
        )
    console.print(line + ".")


# --- 6 · Final output -----------------------------------------------------------------------
def final_output(ex: Explanation, console: Console, number: int) -> None:
    t = ex.trace
    _title(console, number, "Final output")
    console.print(Text.assemble((t.tokenization.text, "dim"), (t.output_text, "bold green")))
    decode = t.decode_steps
    rate = len(decode) / sum(s.seconds for s in decode) if decode else 0.0
    console.print(
        f"{len(t.steps)} tokens ({t.finish_reason}): pre-fill "
        f"{ms(t.prefill.seconds)}, then {rate:.1f} tokens/s while decoding."
    )


# --- extras ---------------------------------------------------------------------------------
def no_cache(c: NoCacheComparison, console: Console, number: int) -> None:
    _title(console, number, "Without the KV cache")
    console.print(
        f"The same {c.tokens} tokens, generated again recomputing every earlier token "
        f"at each step: {c.cached_s:.2f} s with the cache, {c.uncached_s:.2f} s "
        f"without: [bold]{c.slowdown:.1f}× slower[/] (measured)."
    )
    console.print(
        f"Work: {c.cached_flops / 1e9:.1f} GFLOP with the cache, "
        f"{c.uncached_flops / 1e9:.1f} GFLOP without "
        f"({c.flops_ratio:.1f}×, {(c.uncached_flops - c.cached_flops) / 1e9:.1f} GFLOP "
        f"extra). Same tokens both ways: {'yes' if c.same_tokens else 'no'}."
    )


def training(w: TrainingWalk, console: Console, number: int) -> None:
    _title(console, number, "Training vs inference")
    console.print(
        Text.assemble(
            "Training on ",
            (repr(w.sentence), "bold"),
            f" ({len(w.tokens)} tokens) with plain gradient descent, "
            f"learning rate {w.learning_rate}, on a copy of the weights: "
            "predict each next token → loss → gradient → update.",
        )
    )
    table = Table("step", "loss", f"p({w.tokens[-1]!r} last)", "gradient norm", "update norm")
    for s in w.steps:
        table.add_row(
            str(s.step),
            f"{s.loss:.3f}",
            pct(s.target_prob),
            f"{s.grad_norm:.2f}",
            f"{s.update_norm:.4f}",
        )
    table.add_row("after", f"{w.final_loss:.3f}", pct(w.final_target_prob), "", "")
    console.print(table)
    console.print(
        f"Loss {w.steps[0].loss:.3f} → {w.final_loss:.3f}: training changed "
        f"{w.weights_changed} of {w.weights_total} weight tensors of the copy. "
        "The served weights after all the generating above: "
        + (
            "[bold]bit-identical[/] (inference does not learn)."
            if w.inference_unchanged
            else "[red]changed[/]."
        )
    )
