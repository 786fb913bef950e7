"""Helpers several test files share (fixtures are in conftest.py): a tiny training corpus and
config, a uvicorn server on a free loopback port, and ways to compare logit tables."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import torch
import torch.nn.functional as F
import uvicorn
from fastapi import FastAPI

from pellucid.train.config import TrainConfig

KEY = "test-key"  # the API key of the servers the tests start
MODEL = "smollm2-135m"

WORDS = [
    "the",
    "king",
    "and",
    "queen",
    "of",
    "france",
    "speak",
    "to",
    "a",
    "fool",
    "who",
    "sings",
    "of",
    "love",
    "war",
    "and",
    "wine",
]


def tiny_text(n_words: int = 6000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    while n_words > 0:
        k = rng.randint(3, 9)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n_words -= k
    return "\n".join(lines) + "\n"


def prepare_tiny_corpus(folder: Path, tokenizer: str) -> Path:
    """folder/data: the tiny text tokenized by "char", "byte", or "bpe" (a 300-token BPE trained
    on it first by `pellucid tokenizer train`, as a user would)."""
    from pellucid.cli import main
    from pellucid.train.data import prepare

    (folder / "t.txt").write_text(tiny_text(3000))
    if tokenizer == "bpe":
        bpe = folder / "bpe"
        main(
            ["tokenizer", "train", str(folder / "t.txt"), "--vocab-size", "300", "--out", str(bpe)]
        )
        tokenizer = str(bpe)
    prepare([str(folder / "t.txt")], tokenizer, folder / "data")
    return folder / "data"


def tiny_config(data: Path, out: Path, **kw) -> TrainConfig:
    base = {
        "data": str(data),
        "out": str(out),
        "n_layers": 2,
        "n_heads": 2,
        "dim": 32,
        "block_size": 16,
        "batch_size": 4,
        "max_iters": 20,
        "warmup_iters": 5,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "eval_interval": 10,
        "eval_iters": 2,
        "ckpt_interval": 5,
        "threads": 1,
    }
    return TrainConfig(**{**base, **kw})


@dataclass
class Running:
    url: str
    app: FastAPI

    @property
    def state(self):
        return self.app.state.pellucid


def client_of(running: Running) -> openai.OpenAI:
    """An OpenAI client of a test server: the tests' key, no retries (a failure shows at once)."""
    return openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[Running]:
    """Serve `app` with uvicorn on a free loopback port in a thread; stop it on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield Running(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def centred_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """How alike two (tokens, vocab) logit tables point, each row's mean taken out (a constant
    shift of a row changes no probability)."""
    a, b = (x - x.mean(-1, keepdim=True) for x in (a, b))
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


# The perplexity reference's first 1,025 ids (tests/data/REFERENCE.md, section 5): its first two
# chunks of 512 targets, so that Gemma's 512-token sliding window is passed and half its tokens
# are scored beyond it
REFERENCE_SPAN = 1025


def reference_span(perplexity: dict) -> tuple[list[int], torch.Tensor]:
    """The reference's first REFERENCE_SPAN ids, and transformers' float32 NLLs of their
    targets, (REFERENCE_SPAN - 1,) float64 (its `perplexity` section: one forward over the ids,
    on the same dequantized GGUF weights)."""
    ids = perplexity["token_ids"][:REFERENCE_SPAN]
    return ids, torch.tensor(perplexity["hf_token_nll"][: len(ids) - 1], dtype=torch.float64)


def token_nlls(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1,) float64: -log p of each of ids[1:] under the (len(ids), vocab) logits of
    ids, as logsumexp(row) - row[target]. torch's logsumexp subtracts the row's max first, so
    float32 keeps far more precision than the tests ask, without copying Gemma's 262k-wide rows
    to float64 for a log_softmax."""
    logits = logits[:-1].float()
    picked = logits.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logits.logsumexp(-1).double() - picked.double()


def next_token_nll(logits: torch.Tensor, ids: list[int]) -> float:
    """The mean negative log-likelihood of ids[1:] under the (len(ids), vocab) logits of ids."""
    return token_nlls(logits, ids).mean().item()
