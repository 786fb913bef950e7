"""The `pellucid` command: generate, chat, tokenize, models, and the commands of the packages
below (serve, explain, agent, train...). For example:

    pellucid generate "The capital of France is" --temperature 0 --max-tokens 8
    pellucid chat
    pellucid tokenize "Hello world" --json
    pellucid models
    pellucid explain "The capital of India is" --compare-no-cache --html report.html
    pellucid agent "What is 17*23, and who wrote Hamlet?" --tools calculator,search
"""

from __future__ import annotations

import argparse
import json
import sys

from pellucid import catalog
from pellucid.agent.cli import add_agent_command
from pellucid.errors import PellucidError
from pellucid.server.cli import add_serve_args, run_serve
from pellucid.train.cli import add_training_commands


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (PellucidError, ValueError) as e:  # errors meant for the user: one line, no traceback
        print(f"pellucid: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pellucid", description="An LLM engine you can see through."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--quiet", action="store_true", help="do not print the timing line")
    gen.set_defaults(run=run_generate)

    chat = commands.add_parser("chat", help="talk to the model (/reset, /exit)")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.set_defaults(run=run_chat)

    tok = commands.add_parser("tokenize", help="show the tokens (pieces and ids) of a text")
    tok.add_argument("text")
    tok.add_argument("--json", action="store_true", help="print JSON instead of a table")
    tok.add_argument("--model", help=f"model name or path (default {catalog.DEFAULT_MODEL})")
    tok.set_defaults(run=run_tokenize)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_model_args(serve)
    add_serve_args(serve)
    serve.set_defaults(run=run_serve)

    models = commands.add_parser("models", help="list the models available locally")
    models.set_defaults(run=run_models)

    ahead = commands.add_parser(
        "compile",
        help="compile the decode step ahead of time for a model's architecture; later "
        "processes load it in milliseconds (a minute or two per kind of step, once)",
    )
    ahead.add_argument(
        "--model", help=f"model name, GGUF file or HF folder (default {catalog.DEFAULT_MODEL})"
    )
    ahead.add_argument("--force", action="store_true", help="build again what was built before")
    ahead.add_argument(
        "--kind",
        choices=["few-rows", "many-rows"],  # aot_decode.KINDS
        help="build one kind of step only (default all; processes can build one each)",
    )
    ahead.set_defaults(run=run_compile)
    add_explain_command(commands)
    add_patch_command(commands)
    add_agent_command(commands)  # the tool loop
    add_training_commands(commands)  # data prepare, train, export
    return parser


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help=f"model name, GGUF file or HF folder (default {catalog.DEFAULT_MODEL})"
    )
    p.add_argument(
        "--dtype",
        default="int4",
        choices=["int4", "float32", "bfloat16", "float16"],
        help="int4 (default): the fast path (int4 weights; an int8 LM head, or int4 with its "
        "likeliest logits rechecked where the head outweighs the decoder; bf16 KV cache); "
        "float32: the reference, matching Hugging Face transformers' logits",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step: faster decoding after a compile of tens of "
        "seconds (shorter once cached)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # Defaults follow llama.cpp's command line: mildly random, trimmed tails.
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from pellucid.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def load(args: argparse.Namespace):
    from pellucid.llm import LLM  # imported late so `pellucid --help` stays instant

    return LLM(
        args.model, dtype=getattr(args, "dtype", "int4"), compile=getattr(args, "compile", False)
    )


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load(args)
    if args.chat:
        stream = llm.chat_stream([{"role": "user", "content": args.prompt}], params)
    else:
        stream = llm.stream(args.prompt, params)
    last = None
    for last in stream:
        print(last.delta, end="", flush=True)
    print()
    if last is not None and not args.quiet:
        print(f"[{last.timings.summary()}; finish: {last.finish_reason}]", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("Chatting with", llm.path.name, "- /reset starts over, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            print("(conversation reset)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for out in llm.chat_stream(messages, params):
            print(out.delta, end="", flush=True)
            reply = out.text
        print()
        messages.append({"role": "assistant", "content": reply})


def run_tokenize(args: argparse.Namespace) -> int:
    from pellucid.tokenizer import Tokenizer
    from pellucid.weights.gguf_file import read_metadata

    path = catalog.resolve(args.model)
    if path.is_dir():
        tok = Tokenizer.from_hf_folder(path)
    else:
        tok = Tokenizer.from_gguf_metadata(read_metadata(path))
    ids = tok.encode(args.text, add_special=True, parse_special=True)
    pieces = [tok.id_to_piece(i) for i in ids]
    if args.json:
        print(json.dumps({"ids": ids, "pieces": pieces}, ensure_ascii=False))
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table("#", "id", "piece", title=f"{len(ids)} tokens")
    for n, (i, piece) in enumerate(zip(ids, pieces)):
        shown = piece.replace("\n", "\\n").replace("\t", "\\t")  # whitespace made visible
        table.add_row(str(n), str(i), Text(f"'{shown}'"))  # Text: no markup parsing of pieces
    Console().print(table)
    return 0


def run_models(args: argparse.Namespace) -> int:
    for entry in catalog.CATALOG:
        default = " (default)" if entry.name == catalog.DEFAULT_MODEL else ""
        print(f"{entry.name}{default}: {entry.description}")
        if entry.is_installed():
            print(f"  from package {entry.package}: {entry.path()}")
        else:
            print(f"  not installed; {entry.install}")
    print("Any local GGUF file or Hugging Face folder (config.json + *.safetensors) works too:")
    print_supported()
    return 0


def print_supported() -> None:
    """The families, tokenizers and weight types pellucid loads, and how each was checked."""
    from rich.console import Console
    from rich.table import Column, Table

    from pellucid.loading.supported import FAMILIES, LLAMA_CPP_VOCABS, NOT_YET
    from pellucid.weights.gguf_file import SUPPORTED_TYPES

    family = Column("family", no_wrap=True)
    table = Table(family, "config.json / GGUF", "implemented", "checked against")
    for f in FAMILIES:
        table.add_row(
            f.name, f"{', '.join(f.hf_model_types)} / {', '.join(f.gguf_archs)}", f.what, f.checked
        )
    console = Console()
    console.print(table)
    weights = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
    console.print(f"GGUF weights: {weights}", soft_wrap=True)
    vocabs = ", ".join(LLAMA_CPP_VOCABS)
    console.print(f"Tokenizers passing llama.cpp's own tests: {vocabs}", soft_wrap=True)
    console.print(f"Not yet: {NOT_YET}", soft_wrap=True)


def run_compile(args: argparse.Namespace) -> int:
    import time

    from pellucid.config import EngineConfig
    from pellucid.engine.aot_decode import KINDS
    from pellucid.llm import LLM

    start = time.perf_counter()
    kinds = [k for k, name in KINDS.items() if args.kind in (None, name)]
    llm = LLM(args.model, engine=EngineConfig(compiled_ahead=False))
    print(f"Compiling the decode step of {llm.path.name} ahead of time...", file=sys.stderr)
    for path in llm.engine.model_runner.compile_ahead(args.force, kinds):
        print(path)
    print(f"[done in {time.perf_counter() - start:.0f} s]", file=sys.stderr)
    return 0


def add_explain_command(commands: argparse._SubParsersAction) -> None:
    ex = commands.add_parser("explain", help="walk through how the model generates an answer")
    ex.add_argument("prompt")
    ex.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    add_model_args(ex)
    add_sampling_args(ex)
    ex.set_defaults(max_tokens=16, seed=0, run=run_explain)  # short and reproducible
    ex.add_argument("--layer", type=int, help="attention layer to show (default: picked)")
    ex.add_argument("--head", type=int, help="attention head to show (default: picked)")
    ex.add_argument("--focus", help="prompt word whose attention is described (default: last)")
    ex.add_argument(
        "--compare-no-cache",
        action="store_true",
        help="generate again without the KV cache and report the slowdown",
    )
    ex.add_argument(
        "--training",
        action="store_true",
        help="a few gradient steps on a sentence, on a copy of the weights",
    )
    ex.add_argument(
        "--train-text",
        default="The capital of India is New Delhi.",
        help="the sentence --training learns",
    )
    ex.add_argument("--html", metavar="FILE", help="write one self-contained interactive page")
    ex.add_argument("--png", metavar="DIR", help="write plots (attention, timing, KV, odds)")
    ex.add_argument("--json", metavar="FILE", help="write the trace records as JSON")


def add_patch_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "patch", help="activation patching: which layers and positions carry a difference"
    )
    p.add_argument("clean", help='e.g. "The capital of France is"')
    p.add_argument("corrupted", help='as many tokens, one word changed: "The capital of Italy is"')
    p.add_argument(
        "--site",
        choices=["resid_post", "z"],
        default="resid_post",
        help="patch the residual stream per position, or each head's output (z)",
    )
    p.add_argument("--png", metavar="FILE", help="write the heatmap")
    add_model_args(p)
    p.set_defaults(run=run_patch)


def run_patch(args: argparse.Namespace) -> int:
    from pellucid.probing import activation_patching

    result = activation_patching(load(args), args.clean, args.corrupted, args.site)
    print(
        f"clean answer {result.answers[0]!r}, corrupted {result.answers[1]!r}; logit difference "
        f"{result.clean:.2f} clean, {result.corrupted:.2f} corrupted; share restored:"
    )
    print(result.table())
    if args.png:
        print(f"wrote {result.write_png(args.png)}", file=sys.stderr)
    return 0


def run_explain(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pellucid.trace.explain import explain
    from pellucid.trace.terminal import render

    params = sampling_params(args)
    llm = load(args)
    ex = explain(
        llm,
        args.prompt,
        params,
        layer=args.layer,
        head=args.head,
        focus=args.focus,
        chat=args.chat,
        compare_no_cache=args.compare_no_cache,
        training=args.training,
        train_text=args.train_text,
    )
    render(ex, Console())
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(ex.to_dict(), ensure_ascii=False))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.html:
        from pellucid.trace.html import write_html

        print(f"wrote {write_html(ex, args.html)}", file=sys.stderr)
    if args.png:
        from pellucid.trace.plots import write_plots

        for path in write_plots(ex, args.png):
            print(f"wrote {path}", file=sys.stderr)
    return 0
