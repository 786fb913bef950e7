"""Data parallel training: 2 processes under torchrun (gloo, CPU) take the same steps as 1 process
at the same global batch, up to floating-point summation order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_text

from pellucid.train.checkpoint import load_checkpoint
from pellucid.train.config import TrainConfig
from pellucid.train.data import prepare
from pellucid.train.trainer import Trainer

pytestmark = pytest.mark.slow  # torchrun starts two training processes


def cli_args(cfg: TrainConfig) -> list[str]:
    args = []
    for name, value in cfg.to_dict().items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return args


@pytest.mark.parametrize("grad_accum", [1, 2])  # 2: the first micro-step skips the all-reduce
def test_two_processes_match_one(tmp_path: Path, grad_accum: int):
    (tmp_path / "t.txt").write_text(tiny_text())
    prepare([str(tmp_path / "t.txt")], "char", tmp_path / "data")
    cfg = tiny_config(
        tmp_path / "data",
        tmp_path / "one",
        max_iters=8,
        eval_interval=4,
        ckpt_interval=0,
        dtype="float32",
        grad_accum=grad_accum,
    )
    one = Trainer(cfg, verbose=False).run()
    two_out = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        # Rank 0 serves the rendezvous store on this address; the default is the
        # host name, which need not resolve (CI's does not).
        "--local-addr",
        "127.0.0.1",
        "--nproc-per-node",
        "2",
        "-m",
        "pellucid",
        "train",
        *cli_args(cfg),
        "--out",
        str(two_out),
        "--no-export",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = load_checkpoint(two_out)
    two = [loss for _, loss in ckpt["history"]["train"]]
    assert "2 process(es)" in proc.stderr
    assert two == pytest.approx(one.train_losses, rel=1e-5)
    for name, tensor in load_checkpoint(tmp_path / "one")["model"].items():
        torch.testing.assert_close(ckpt["model"][name], tensor, rtol=1e-4, atol=1e-5)
