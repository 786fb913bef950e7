"""The training commands of `pellucid`: data prepare, tokenizer train, train, scale, sft, eval
(its run: eval_cli.py), speedrun, export.

pellucid data prepare shakespeare --tokenizer char --out data/shakespeare_char
pellucid train --data data/shakespeare_char --out runs/baby          # nanoGPT's baby GPT size
pellucid train --out runs/baby --resume                               # continue where it stopped
torchrun --nproc-per-node 2 -m pellucid train --data ... --out ...   # data parallel (gloo)
pellucid export runs/baby --out models/baby && pellucid generate "ROMEO:" --model models/baby
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, get_args

from pellucid.cpu import matmul_float
from pellucid.train.eval_cli import run_eval


def add_training_commands(commands: Any) -> None:
    """Add `data`, `tokenizer`, `train`, `scale`, `sft`, `eval`, `speedrun` and `export` to the
    `pellucid` sub-command parser."""
    data = commands.add_parser("data", help="prepare token shards for training")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prep = data_commands.add_parser(
        "prepare",
        help="text files, folders, JSONL or a named corpus -> train.bin / val.bin + tokenizer.json",
    )
    prep.add_argument(
        "sources", nargs="+", help="shakespeare, shakespeare-plays, kjv, wiki, a file or folder"
    )
    prep.add_argument(
        "--tokenizer",
        default="char",
        help="char, byte, or a folder/tokenizer.json from `pellucid tokenizer train`",
    )
    prep.add_argument("--out", required=True, type=Path)
    prep.add_argument("--val-fraction", type=float, default=0.1)
    prep.set_defaults(run=run_prepare)

    tok = commands.add_parser("tokenizer", help="train a tokenizer")
    tok_commands = tok.add_subparsers(dest="tokenizer_command", required=True)
    bpe = tok_commands.add_parser("train", help="byte-level BPE -> tokenizer.json")
    bpe.add_argument("sources", nargs="+", help="shakespeare, shakespeare-plays, a file or folder")
    bpe.add_argument("--vocab-size", type=int, default=4096)
    bpe.add_argument("--out", required=True, type=Path)
    bpe.set_defaults(run=run_tokenizer_train)

    train = commands.add_parser("train", help="train a model from scratch on prepared data")
    add_config_args(train)
    train.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    train.add_argument("--no-export", action="store_true", help="skip writing OUT/model")
    train.set_defaults(run=run_train)

    scale = commands.add_parser("scale", help="sweep model sizes x token budgets, fit loss(C)")
    scale.add_argument("--data", required=True, help="a folder from `pellucid data prepare`")
    scale.add_argument("--out", required=True, type=Path)
    scale.add_argument(
        "--iters",
        type=int,
        nargs="+",
        default=None,
        help="token budgets in iterations (default 250 500 1000)",
    )
    scale.add_argument("--dtype", default=matmul_float(), choices=["bfloat16", "float32"])
    scale.add_argument("--threads", type=int)
    scale.set_defaults(run=run_scale)

    sft = commands.add_parser("sft", help="fine-tune a chat model on chat JSONL (LoRA or full)")
    sft.add_argument("--model", default="smollm2-135m", help="catalog name, GGUF file or HF folder")
    sft.add_argument("--data", required=True, help='JSONL, one {"messages": [...]} per line')
    sft.add_argument("--out", required=True, help="the fine-tuned model's HF folder")
    sft.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tuning")
    sft.add_argument("--lora-alpha", type=float, default=16.0)
    sft.add_argument("--epochs", type=int, default=3)
    sft.add_argument("--batch-size", type=int, default=4)
    sft.add_argument("--lr", type=float, help="default 1e-3 with LoRA, 3e-5 full")
    sft.add_argument("--max-len", type=int, default=512)
    sft.add_argument("--dtype", default=matmul_float(), choices=["bfloat16", "float32"])
    sft.set_defaults(run=run_sft)

    ev = commands.add_parser(
        "eval",
        help="bits per byte on held-out text, multiple-choice accuracy, generation checks, "
        "BFCL tool calling",
    )
    ev.add_argument("--model", default=None, help="a catalog name, a folder or a .gguf file")
    ev.add_argument("--dtype", default="int4", help="int4 (the default path) or float32")
    ev.add_argument(
        "--bpb",
        nargs="*",
        default=None,
        metavar="SOURCE",
        help="corpora (shakespeare, kjv) or text files (default: shakespeare and kjv)",
    )
    ev.add_argument(
        "--task",
        nargs="*",
        default=[],
        metavar="JSONL",
        help="multiple-choice files (question, choices, answer a line), generation checks "
        "(prompt, targets a line), bigbench:NAME (either kind), or bfcl:CATEGORY (simple, "
        "multiple, parallel, parallel_multiple, irrelevance)",
    )
    ev.add_argument(
        "--chat",
        action="store_true",
        help="generation checks as user turns in the chat template, each reply to its own end",
    )
    ev.add_argument("--max-tokens", type=int, default=32, help="of a generation check's reply")
    ev.add_argument(
        "--limit", type=_at_least_one, help="each task's first N questions (default all)"
    )
    ev.add_argument("--max-bytes", type=int, default=100_000, help="of each text scored")
    ev.add_argument("--json", type=Path, help="write the results here")
    ev.add_argument(
        "--report",
        type=Path,
        help="write a report card here (markdown): every model's eval table, sample chats",
    )
    ev.add_argument(
        "--compare",
        nargs="*",
        default=None,
        metavar="MODEL",
        help="models measured beside it on the same tasks (default with --report: "
        "smollm2-135m gemma3-270m)",
    )
    ev.add_argument(
        "--training-run",
        type=Path,
        help="the --out folder of the run that trained it: the report's training part",
    )
    ev.set_defaults(run=run_eval)

    run = commands.add_parser(
        "speedrun",
        help="tokenizer -> pre-train sized to the minutes -> SFT -> eval -> export -> report",
    )
    run.add_argument("--out", type=Path, default=Path("runs/speedrun"))
    run.add_argument("--minutes", type=float, default=35.0, help="of pre-training (default 35)")
    run.add_argument("--vocab-size", type=int, default=8192)
    run.add_argument("--block-size", type=int, default=512, help="the model's context")
    run.add_argument("--max-chars", type=int, help="of pre-training text (default all)")
    run.add_argument("--sft-chats", type=int, default=2000)
    run.add_argument("--held-out-chats", type=int, default=50)
    run.add_argument(
        "--compare", nargs="*", default=["smollm2-135m", "gemma3-270m"], metavar="MODEL"
    )
    run.set_defaults(run=run_speedrun)

    export = commands.add_parser("export", help="training run -> HF model folder or .gguf file")
    export.add_argument("run_dir", type=Path, help="the --out folder of a training run")
    export.add_argument("--out", required=True, type=Path)
    export.set_defaults(run=run_export)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return int(text)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """One --flag per TrainConfig field, with the field's default and type."""
    from pellucid.train.config import TrainConfig

    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _scalar_type(f.type)
        if f.default is MISSING:  # data and out: required unless resuming
            p.add_argument(flag, type=kind)
        elif str(f.type) == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            shown = "this machine's choice" if f.default is None else f.default
            p.add_argument(flag, type=kind, default=f.default, help=f"default {shown}")


def _scalar_type(annotation: Any) -> type:
    text = str(annotation)
    for kind in (int, float, str):
        if text.startswith(kind.__name__) or kind in get_args(annotation):
            return kind
    return str


def run_prepare(args: argparse.Namespace) -> int:
    from pellucid.train.data import prepare

    meta = prepare(args.sources, args.tokenizer, args.out, args.val_fraction)
    print(
        f"{args.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"({meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']}, {meta['dtype']})"
    )
    return 0


def run_tokenizer_train(args: argparse.Namespace) -> int:
    from pellucid.tokenizer import Tokenizer
    from pellucid.train.bpe import save_bpe, train_bpe
    from pellucid.train.data import read_sources

    text = read_sources(args.sources)
    save_bpe(train_bpe(text, args.vocab_size, show_progress=sys.stderr.isatty()), args.out)
    tok = Tokenizer.from_hf_folder(args.out)  # check the engine reads what was written
    sample = text[:10_000]
    ratio = len(sample.encode()) / max(1, len(tok.encode(sample)))
    print(f"{args.out}/tokenizer.json: {tok.vocab_size} tokens, {ratio:.2f} bytes per token")
    return 0


def run_train(args: argparse.Namespace) -> int:
    from pellucid.train import ddp
    from pellucid.train.config import TrainConfig
    from pellucid.train.export import export_checkpoint
    from pellucid.train.hf_export import export_hf
    from pellucid.train.trainer import Trainer

    if args.out is None:
        raise ValueError("--out is required: the folder for checkpoints and the trained model")
    if args.resume:
        from pellucid.train.checkpoint import load_checkpoint

        cfg = TrainConfig.from_dict(load_checkpoint(Path(args.out))["config"])
    else:
        if args.data is None:
            raise ValueError("--data is required: a folder from `pellucid data prepare`")
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    trainer = Trainer(cfg, resume=args.resume)
    try:
        result = trainer.run()
    finally:
        ddp.shutdown(trainer.dist)
    if trainer.dist.is_main:
        print(
            f"trained {result.step} steps; final val loss {result.val.get(result.step, float('nan')):.4f};"
            f" {result.tokens_per_s:,.0f} tokens/s",
            file=sys.stderr,
        )
        if not args.no_export:
            out = Path(cfg.out)
            if cfg.fsdp:  # gathered from the shards just saved
                folder = export_checkpoint(out, out / "model")
            else:
                folder = export_hf(trainer.model, out, out / "model")
            print(f'model: {folder}  (pellucid generate "..." --model {folder})', file=sys.stderr)
    return 0


def run_scale(args: argparse.Namespace) -> int:
    from pellucid.train import scale
    from pellucid.train.config import TrainConfig

    base = TrainConfig(data=args.data, out=str(args.out), dtype=args.dtype, threads=args.threads)
    runs = scale.run_sweep(
        base,
        args.out / "runs",
        iters=tuple(args.iters or scale.ITERS),
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(scale.report(runs, scale.fit_power_law(runs), scale.fit_params_law(runs), args.out))
    print(f"{args.out}/scale.png, {args.out}/scale.json")
    return 0


def run_sft(args: argparse.Namespace) -> int:
    from pellucid.train.sft import SFTConfig, fine_tune

    cfg = SFTConfig(
        model=args.model,
        data=args.data,
        out=args.out,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        max_len=args.max_len,
        dtype=args.dtype,
    )
    folder = fine_tune(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{folder}  (pellucid chat --model {folder})")
    return 0


def run_speedrun(args: argparse.Namespace) -> int:
    from pellucid.train.speedrun import speedrun
    from pellucid.train.speedrun_config import SpeedrunConfig

    cfg = SpeedrunConfig(
        out=args.out,
        minutes=args.minutes,
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        max_chars=args.max_chars,
        sft_chats=args.sft_chats,
        held_out_chats=args.held_out_chats,
        compare=tuple(args.compare),
    )
    path = speedrun(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{path}  (pellucid chat --model {args.out / 'chat'})")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from pellucid.train.export import export_checkpoint

    path = export_checkpoint(args.run_dir, args.out)
    kind = (
        "GGUF, float32"
        if path.suffix == ".gguf"
        else "config.json, model.safetensors, tokenizer.json"
    )
    print(f'{path}: {kind}  (pellucid generate "..." --model {path})')
    return 0
