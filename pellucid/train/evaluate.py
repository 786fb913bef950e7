"""`pellucid eval`: how good a model is, measured on the same scale for any model pellucid loads.

- bits per byte on held-out text: -log2 p of each token, summed, over the UTF-8 bytes those
  tokens stand for; comparable across tokenizers (a model with a larger vocabulary takes fewer,
  harder tokens for the same bytes). The text is a named corpus's last tenth (the part
  `pellucid data prepare` keeps for validation) or a file, read in windows of the context.
- multiple choice from JSONL (`{"question": ..., "choices": [...], "answer": index}` a line), or
  a BIG-bench task from its package (`bigbench:NAME`, bigbench.py): each
  choice scored by its log-likelihood after the question (`acc`) and per byte of the choice
  (`acc_norm`, lm-evaluation-harness's length normalization).
- generation checks from JSONL (`{"prompt": ..., "targets": [...], "stop": [...]}` a line, stop
  optional), or a BIG-bench task whose examples have a `target` instead of choices: greedy
  replies, cut at a stop string (default: the first line break), scored by exact match with a
  target (after trimming spaces) and by whether a target appears in the reply; `chat=True` asks
  each prompt as a user turn in the model's chat template and lets the reply run to the model's
  own end of turn, and the share of replies that ended on their own (not at max_tokens) says
  whether it stops.
- tool calling on BFCL v4 (`bfcl:simple`, `bfcl:multiple`, `bfcl:parallel`,
  `bfcl:parallel_multiple`, `bfcl:irrelevance`; bfcl.py): greedy replies to each question with
  its tools offered and the tool-call grammar on; valid calls, and AST accuracy by BFCL's own
  checker.

Every pass is a request through the engine, many at a time: scoring requests
(`LLM.prompt_logprobs`) for the first two, generation for the checks and tool calls. `advance(n)`, where a
function takes it, is told of each n units of work done (a progress bar).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pellucid.engine import SamplingParams
from pellucid.errors import PellucidError
from pellucid.llm import LLM
from pellucid.train import bfcl, bigbench
from pellucid.train.corpora import corpus_text

HELD_OUT = 0.1  # the tail of a corpus `data prepare` keeps for validation
BATCH = 32  # scoring requests submitted together


class EvalError(PellucidError):
    """A task file or corpus that cannot be read; the message names it and what to do."""


@dataclass
class BitsPerByte:
    source: str
    bits_per_byte: float
    tokens: int  # scored (each window's first token has nothing before it)
    bytes: int  # what the scored tokens stand for


@dataclass
class MultipleChoice:
    task: str
    questions: int
    acc: float
    acc_norm: float


@dataclass
class Generation:
    task: str
    questions: int
    exact_match: float  # replies equal to a target, spaces trimmed
    contains: float  # replies with a target in them
    stopped: float  # replies that ended on their own (end of turn, line break), not at max_tokens
    chat: bool  # asked as a user turn in the chat template


@dataclass
class ToolCalling:
    task: str
    questions: int
    valid: float  # replies that are only valid calls (irrelevance: that make none)
    ast_accuracy: float  # calls BFCL's checker accepts
    duplicate_calls: int
    cut_off: int  # replies that ended at max_tokens


Advance = Callable[[int], None]


def bits_per_byte(
    llm: LLM,
    source: str,
    max_bytes: int = 100_000,
    window: int = 1024,
    advance: Advance | None = None,
) -> BitsPerByte:
    """On held-out text (`source`: a corpus name or a text file), up to `max_bytes` of it, in
    windows of `window` tokens (fewer if the context is shorter), each scored on its own;
    `advance` counts windows."""
    windows = text_windows(llm, source, max_bytes, window)
    bits, n_bytes, n_tokens = 0.0, 0, 0
    for at in range(0, len(windows), BATCH):
        for rows in llm.prompt_logprobs(windows[at : at + BATCH]):
            bits -= sum(r.logprob for r in rows) / math.log(2)
            n_bytes += sum(len(llm.tokenizer.id_to_bytes(r.token_id)) for r in rows)
            n_tokens += len(rows)
        if advance is not None:
            advance(len(windows[at : at + BATCH]))
    if n_bytes == 0:
        raise EvalError(f"{source}: no text to score (it is empty or one token long)")
    return BitsPerByte(source, bits / n_bytes, n_tokens, n_bytes)


def text_windows(llm: LLM, source: str, max_bytes: int, window: int = 1024) -> list[list[int]]:
    """The token ids bits_per_byte scores, a window at a time."""
    text = held_out_text(source)[:max_bytes]
    ids = llm.tokenizer.encode(text, add_special=False, parse_special=False)
    window = min(window, llm.engine.max_model_len - 1)  # a scoring request generates one token
    windows = [ids[at : at + window] for at in range(0, len(ids), window)]
    return [w for w in windows if len(w) > 1]


def held_out_text(source: str) -> str:
    """A named corpus's last tenth, cut at a line, or a text file whole."""
    text = corpus_text(source)
    if text is not None:
        return text[_held_out_start(text) :]
    path = Path(source)
    if not path.is_file():
        raise EvalError(
            f"{source}: neither a corpus (shakespeare, shakespeare-plays, kjv, wiki) nor a text file"
        )
    return path.read_text(encoding="utf-8", errors="replace")


def training_text(source: str) -> str:
    """A named corpus without the tail held_out_text scores: what a model may train on and still
    be measured on that corpus fairly."""
    text = corpus_text(source)
    if text is None:
        raise EvalError(f"{source}: not a named corpus")
    return text[: _held_out_start(text)]


def _held_out_start(text: str) -> int:
    return text.find("\n", int(len(text) * (1 - HELD_OUT))) + 1


def task_path(spec: str | Path) -> Path:
    """A task file, or `bigbench:NAME`: that BIG-bench task's multiple-choice examples."""
    spec = str(spec)
    if spec.startswith(bigbench.PREFIX):
        try:
            return bigbench.task_file(spec.removeprefix(bigbench.PREFIX))
        except ValueError as e:
            raise EvalError(str(e)) from None
    return Path(spec)


def multiple_choice(
    llm: LLM, path: str | Path, limit: int | None = None, advance: Advance | None = None
) -> MultipleChoice:
    """Accuracy on a JSONL task (or `bigbench:NAME`), its first `limit` questions (None: all):
    the choice with the highest log-likelihood after the question (`acc`), and with the highest
    per byte (`acc_norm`); `advance` counts choices scored."""
    name = str(path)
    path = task_path(path)
    docs = read_task(path)[:limit]
    tok = llm.tokenizer
    sequences, spans = [], []  # spans: (question's tokens, choice's bytes) per sequence
    for doc in docs:
        question = tok.encode(doc["question"], add_special=True, parse_special=False)
        for choice in doc["choices"]:
            cont = tok.encode(choice, add_special=False, parse_special=False)
            sequences.append(question + cont)
            spans.append((len(question), len(choice.encode())))
    scores = []
    for at in range(0, len(sequences), BATCH):
        for rows, (n_question, _) in zip(
            llm.prompt_logprobs(sequences[at : at + BATCH]), spans[at : at + BATCH]
        ):
            scores.append(sum(r.logprob for r in rows[n_question - 1 :]))
        if advance is not None:
            advance(len(sequences[at : at + BATCH]))
    acc = acc_norm = 0
    at = 0
    for doc in docs:
        n = len(doc["choices"])
        mine, sizes = scores[at : at + n], [size for _, size in spans[at : at + n]]
        acc += max(range(n), key=mine.__getitem__) == doc["answer"]
        acc_norm += max(range(n), key=lambda i: mine[i] / max(sizes[i], 1)) == doc["answer"]
        at += n
    task = name if name.startswith(bigbench.PREFIX) else path.stem
    return MultipleChoice(task, len(docs), acc / len(docs), acc_norm / len(docs))


def generation(
    llm: LLM,
    path: str | Path,
    limit: int | None = None,
    advance: Advance | None = None,
    chat: bool = False,
    max_tokens: int = 32,
) -> Generation:
    """Greedy replies to a generation task's prompts (JSONL, or `bigbench:NAME`), its first
    `limit` (None: all), `max_tokens` each; `advance` counts replies. Without `chat` a reply is
    cut at its stop strings; with it, the prompt is a user turn and the reply ends where
    the model ends its turn."""
    name = str(path)
    path = task_path(path)
    docs = read_generation_task(path)[:limit]
    if chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": d["prompt"]}]) for d in docs]
    else:
        prompts = [llm.encode(d["prompt"]) for d in docs]
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, stop=[] if chat else stops(d))
        for d in docs
    ]
    exact = contains = stopped = 0
    for at in range(0, len(docs), BATCH):
        batch = slice(at, at + BATCH)
        for doc, out in zip(docs[batch], llm.generate(prompts[batch], params[batch])):
            reply, targets = out.text.strip(), [t.strip() for t in doc["targets"]]
            exact += reply in targets
            contains += any(t and t in reply for t in targets)
            stopped += out.finish_reason == "stop"
        if advance is not None:
            advance(len(docs[at : at + BATCH]))
    task = name if name.startswith(bigbench.PREFIX) else path.stem
    n = len(docs)
    return Generation(task, n, exact / n, contains / n, stopped / n, chat)


def tool_calling(
    llm: LLM, spec: str, limit: int | None = None, advance: Advance | None = None
) -> ToolCalling:
    """BFCL v4 category `bfcl:NAME`, its first `limit` entries (None: all), replied to from
    Python with the grammar on; `advance` counts replies."""
    category = bfcl.category(spec.removeprefix(bfcl.PREFIX))
    entries = bfcl.load(category, limit)
    checker, language = bfcl.load_checker()
    replies, refused, seconds = bfcl.python_route(
        llm, category, entries, batch=BATCH, advance=advance
    )
    row = bfcl.score(category, entries, replies, refused, seconds, checker, language)
    return ToolCalling(
        spec,
        row["n"],
        row["valid_rate"],
        row["ast_accuracy"],
        row["duplicate_calls"],
        row["hit_max_tokens"],
    )


def task_size(llm: LLM, spec: str, limit: int | None = None) -> int:
    """Units of work of a task, as its function counts them for `advance`."""
    if spec.startswith(bfcl.PREFIX):
        return len(bfcl.load(bfcl.category(spec.removeprefix(bfcl.PREFIX)), limit))
    path = task_path(spec)
    if is_generation(path):
        return len(read_generation_task(path)[:limit])
    return sum(len(doc["choices"]) for doc in read_task(path)[:limit])


def is_generation(path: Path) -> bool:
    """Whether a task file holds generation checks (prompt, targets) rather than questions
    with choices: by its first line's keys."""
    _, first = _json_lines(path, "question, choices, answer, or prompt, targets a line")[0]
    return isinstance(first, dict) and "targets" in first


def read_generation_task(path: Path) -> list[dict]:
    """A generation task's prompts and targets; EvalError naming the file and line of anything
    malformed."""
    docs = []
    for n, doc in _json_lines(path, "prompt, targets a line"):
        ok = (
            isinstance(doc, dict)
            and isinstance(doc.get("prompt"), str)
            and doc["prompt"] != ""
            and isinstance(doc.get("targets"), list)
            and len(doc["targets"]) >= 1
            and all(isinstance(t, str) for t in doc["targets"])
            and isinstance(stops(doc), list)
            and all(isinstance(t, str) and t for t in stops(doc))
        )
        if not ok:
            raise EvalError(
                f'{path}:{n}: expected {{"prompt": non-empty str, "targets": [1+ str], '
                '"stop" (optional): [non-empty str]}'
            )
        docs.append(doc)
    return docs


def stops(doc: dict) -> list[str]:
    """Where a generation check's reply ends (outside chat): its `stop`, else a line break."""
    return doc.get("stop", ["\n"])


def read_task(path: Path) -> list[dict]:
    """The task's questions; EvalError naming the file and line of anything malformed."""
    docs = []
    for n, doc in _json_lines(path, "question, choices, answer a line"):
        ok = (
            isinstance(doc, dict)
            and isinstance(doc.get("question"), str)
            and isinstance(doc.get("choices"), list)
            and len(doc["choices"]) >= 2
            and all(isinstance(c, str) and c for c in doc["choices"])
            and isinstance(doc.get("answer"), int)
            and 0 <= doc["answer"] < len(doc["choices"])
        )
        if not ok:
            raise EvalError(
                f'{path}:{n}: expected {{"question": str, "choices": [2+ non-empty str], '
                '"answer": index of the right choice}'
            )
        docs.append(doc)
    return docs


def _json_lines(path: Path, holds: str) -> list[tuple[int, object]]:
    """(line number, value) of each non-empty line of a JSONL task file; EvalError for a file
    missing, empty, or with a line that is not JSON. `holds`: what its lines hold, to say so."""
    if not path.is_file():
        raise EvalError(f"{path}: no such task file (JSONL: {holds})")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{n}: not JSON ({e.msg})") from None
    if not out:
        raise EvalError(f"{path}: no questions in it")
    return out


def report(results: list[BitsPerByte | MultipleChoice | Generation | ToolCalling]) -> dict:
    """JSON-ready results."""
    return {"results": [{"kind": type(r).__name__, **asdict(r)} for r in results]}
