"""A report card (`pellucid eval --report`): a model's eval table beside reference models measured
on the same tasks in the same run, what each model is, how many bytes a token stands for in each
tokenizer, a few sample chats, and, for a model from a training run, its data, size, training
FLOPs and loss curve.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pellucid.atomic import atomic_path
from pellucid.cpu import cpu_model, isa_flags
from pellucid.engine import SamplingParams
from pellucid.llm import LLM
from pellucid.models.config import ModelConfig
from pellucid.train.checkpoint import load_checkpoint
from pellucid.train.evaluate import BitsPerByte, Generation, MultipleChoice, ToolCalling
from pellucid.train.flops import flops_per_token, n_params
from pellucid.train.plot import plot_losses

Result = BitsPerByte | MultipleChoice | Generation | ToolCalling

# Asked of every model with a chat template: none of them is in the packaged corpora
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours.",
]


@dataclass
class Card:
    """One model's column of the report."""

    name: str
    params: int
    vocab: int
    context: int
    results: list[Result]
    chats: list[tuple[str, str, str]] = field(default_factory=list)  # prompt, reply, finish


def card(name: str, llm: LLM, results: list[Result], max_tokens: int = 64) -> Card:
    """`llm`'s column: its facts, `results`, and its greedy replies to CHAT_PROMPTS when it has
    a chat template."""
    cfg = llm.model.cfg
    # counted on the model as built, not as loaded: packed int4 tensors hold 2 weights an element
    out = Card(name, n_params(cfg), cfg.vocab_size, llm.engine.max_model_len, results)
    if llm.tokenizer.chat_template is not None:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
        replies = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        out.chats = [(p, r.text, r.finish_reason or "") for p, r in zip(CHAT_PROMPTS, replies)]
    return out


def write_report(
    path: Path, cards: list[Card], run: Path | None = None, preface: Sequence[str] = ()
) -> Path:
    """report.md at `path` (its loss curve, for a `run`, beside it as loss.png); `preface`:
    markdown lines put first, after the machine."""
    lines = [f"# Report card: {cards[0].name}", "", *_machine(), "", *preface]
    if run is not None:
        lines += _training(run, path.parent / "loss.png")
    lines += [
        "## Models",
        "",
        "| model | parameters | vocabulary | context |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {c.name} | {c.params:,} | {c.vocab:,} | {c.context:,} |" for c in cards]
    lines += ["", "## Eval (same tasks, same run)", "", *_table(cards), ""]
    for c in cards:
        lines += [f"## Sample chats: {c.name} (greedy)", ""]
        if not c.chats:
            lines += ["No chat template in its files: not asked.", ""]
        else:
            for prompt, reply, finish in c.chats:
                lines += [f"> {prompt}", "", reply.strip() or "(nothing)", "", f"*({finish})*", ""]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))
    return path


def _machine() -> list[str]:
    isa = ", ".join(isa_flags()) or "no AVX"
    return [f"{datetime.date.today()}; {cpu_model()} ({isa}), torch {torch.__version__}"]


def _training(run: Path, plot: Path) -> list[str]:
    """What the run's checkpoint says of its data, size and training, and its loss curve."""
    ckpt = load_checkpoint(run)
    cfg, train = ModelConfig(**ckpt["model_config"]), ckpt["config"]
    tokens = ckpt["step"] * train["batch_size"] * train["block_size"] * train["grad_accum"]
    flops = flops_per_token(cfg, train["block_size"]) * tokens
    history = ckpt["history"]
    last = {k: v[-1][1] for k, v in history.items() if v}
    lines = [
        "## Training",
        "",
        f"- data: `{train['data']}` ({_data(ckpt.get('data_meta', {}))})",
        f"- model: {cfg.arch}, {cfg.n_layers} layers, {cfg.n_heads} heads, dim {cfg.dim}",
        f"- {ckpt['step']:,} steps, {tokens:,} tokens, {flops:.2e} FLOPs (6 a parameter a token, "
        + "plus attention)",
        "- last loss: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items()) + " (nats per token)",
    ]
    if plot_losses(history, plot, f"{run.name}") is not None:
        lines += ["", f"![loss]({plot.name})"]
    return [*lines, ""]


def _data(meta: dict) -> str:
    """The facts `pellucid data prepare` wrote of the run's data (data.py's meta.json)."""
    if not meta:
        return "no facts recorded"
    return (
        f"{', '.join(map(str, meta.get('sources', [])))}; tokenizer {meta.get('tokenizer')}, "
        f"vocabulary {meta.get('vocab_size', 0):,}; {meta.get('characters', 0):,} characters, "
        f"{meta.get('train_tokens', 0):,} training and {meta.get('val_tokens', 0):,} "
        "validation tokens"
    )


def _table(cards: list[Card]) -> list[str]:
    """Rows: each measure any model has; columns: the models."""
    rows: dict[str, dict[int, str]] = {}
    for i, c in enumerate(cards):
        for r in c.results:
            for what, value in cells(r):
                rows.setdefault(what, {})[i] = value
    head = ["| measure | " + " | ".join(c.name for c in cards) + " |"]
    head.append("| --- |" + " --- |" * len(cards))
    body = [
        f"| {what} | " + " | ".join(values.get(i, "") for i in range(len(cards))) + " |"
        for what, values in rows.items()
    ]
    return head + body


def cells(r: Result) -> list[tuple[str, str]]:
    if isinstance(r, BitsPerByte):
        return [
            (f"bits per byte: {Path(r.source).name} (lower is better)", f"{r.bits_per_byte:.4f}"),
            (f"bytes per token: {Path(r.source).name}", f"{r.bytes / max(r.tokens, 1):.2f}"),
        ]
    if isinstance(r, MultipleChoice):
        return [(f"{r.task}: acc / acc_norm ({r.questions})", f"{r.acc:.3f} / {r.acc_norm:.3f}")]
    if isinstance(r, Generation):
        how = " as chat" if r.chat else ""
        return [
            (
                f"{r.task}{how}: exact / contains / stopped ({r.questions})",
                f"{r.exact_match:.3f} / {r.contains:.3f} / {r.stopped:.3f}",
            )
        ]
    return [(f"{r.task}: valid / AST ({r.questions})", f"{r.valid:.3f} / {r.ast_accuracy:.3f}")]
