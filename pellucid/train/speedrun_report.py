"""The speedrun's report card: what each stage did and how long it took, how the size was chosen,
then `pellucid eval`'s report (report.py) of its chat model beside the reference models, measured
on the same held-out text, tasks and held-out chats in the same run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pellucid.errors import PromptError
from pellucid.llm import LLM
from pellucid.train import evaluate as ev
from pellucid.train import report
from pellucid.train.speedrun_config import STAGES, Log, SpeedrunConfig, stage_facts

REPLY_TOKENS = 256  # of each held-out chat reply (the SFT answers are up to ~200 tokens)


def write(cfg: SpeedrunConfig, folder: Path, log: Log) -> Path:
    """Evaluate the chat model and cfg.compare one at a time; report.md in `folder`."""
    cards = []
    for name in [str(cfg.out / "chat"), *cfg.compare]:
        llm = LLM(name, dtype="int4")  # each as `pellucid eval` runs it by default
        label = "speedrun chat" if name == str(cfg.out / "chat") else llm.path.name
        results = measure(llm, cfg, log)
        for line in _summary(label, results):
            log(line)
        cards.append(report.card(label, llm, results))
        del llm
    (folder / "eval.json").write_text(
        json.dumps({c.name: ev.report(c.results)["results"] for c in cards}, indent=1) + "\n"
    )
    for png in (cfg.out / "sizing" / "sizing.png", cfg.out / "chat" / "sft_loss.png"):
        if png.is_file():
            shutil.copy(png, folder / png.name)
    return report.write_report(
        folder / "report.md", cards, cfg.out / "pretrain", preface=stages(cfg)
    )


def measure(llm: LLM, cfg: SpeedrunConfig, log: Log) -> list[report.Result]:
    """Bits per byte on the held-out tails, the tasks, and (with a chat template) the held-out
    chats: does the reply end its turn."""
    results: list[report.Result] = [
        ev.bits_per_byte(llm, source, cfg.eval_bytes) for source in ("shakespeare", "kjv")
    ]
    for task in cfg.tasks:
        # A short context, or a task whose package this machine's index lacks (bigbench 1.0.0
        # was missing from one): the task is left out of this model's column, and the report
        # of an hour's training is still written
        try:
            score = ev.generation if ev.is_generation(ev.task_path(task)) else ev.multiple_choice
            results.append(score(llm, task))
        except (PromptError, ev.EvalError) as e:
            log(f"{llm.path.name}: {task} left out: {e}")
    if llm.tokenizer.chat_template is not None:
        chats = cfg.out / "corpus" / "held_out.jsonl"
        results.append(ev.generation(llm, chats, chat=True, max_tokens=REPLY_TOKENS))
    return results


def stages(cfg: SpeedrunConfig) -> list[str]:
    """The speedrun's own sections: stages and times, data, tokenizer, sizing, SFT."""
    facts = {name: stage_facts(cfg.out, name) for name in STAGES[:-1]}
    total = sum(f["seconds"] for f in facts.values())
    corpus, tok, size = facts["corpus"], facts["tokenizer"], facts["sizing"]
    law = size["law"]
    lines = ["## Speedrun", "", "| stage | wall time |", "| --- | --- |"]
    lines += [f"| {name} | {f['seconds'] / 60:.1f} min |" for name, f in facts.items()]
    lines += [f"| all but this report | {total / 60:.1f} min |", ""]
    lines += ["### Data", ""]
    lines += [
        f"- {name}: {corpus['characters'][name]:,} characters; {corpus['provenance'][name]}"
        for name in corpus["characters"]
    ]
    sft = (
        f"- SFT: {corpus['sft_chats']:,} short ShareGPT exchanges (question ≤ 300 characters, "
        f"answer ≤ 800, ASCII); {corpus['held_out_chats']} more held out for the eval"
    )
    compression = ", ".join(f"{k} {v:.2f}" for k, v in tok["bytes_per_token"].items())
    tokenizer = (
        f"- tokenizer: byte-level BPE, {tok['vocab_size']:,} tokens with <|endoftext|>, "
        f"<|im_start|> and <|im_end|>; bytes per token on the held-out text: {compression}"
    )
    depths = len({r["depth"] for r in size["runs"]})
    sizing = (
        f"{depths} depths each trained on exactly each of {len(law['optima'])} small budgets "
        f"(the valleys, left; each budget's best size, right). The law: N_opt = {law['k']:.3g} "
        f"· C^{law['a']:.3f} ({law['note']}). At this machine's budget, C = "
        f"{size['budget_flops']:.2e} FLOPs ({cfg.minutes:g} minutes), it wants "
        f"{size['wanted_params'] / 1e6:.2f}M parameters: depth {size['depth']} "
        f"({size['params'] / 1e6:.2f}M) was trained."
    )
    chat = facts["chat"]
    lines += [sft, tokenizer, "", "### Size, from IsoFLOP profiles on this data", "", sizing]
    lines += ["", "![IsoFLOP profiles](sizing.png)", ""]
    last = chat["history"][-1][1]
    lines += [f"### SFT: {chat['epochs']} epochs at lr {chat['lr']:g}, last loss {last:.3f}", ""]
    lines += ["![SFT loss](sft_loss.png)", ""]
    return lines


def _summary(name: str, results: list[report.Result]) -> list[str]:
    return [f"{name}: {what} = {value}" for r in results for what, value in report.cells(r)]
