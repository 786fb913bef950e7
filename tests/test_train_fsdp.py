"""Sharded training (FSDP2) under torchrun: 2 processes take the steps 1 process takes; their
sharded checkpoint resumes on 1 process and continues the same curve, and exports the same
model; a run killed mid-save resumes from the checkpoint before."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_text
from test_train_ddp import cli_args

from pellucid.models import build_model
from pellucid.models.config import ModelConfig
from pellucid.train import fsdp
from pellucid.train.checkpoint import load_checkpoint
from pellucid.train.data import prepare
from pellucid.train.trainer import Trainer

pytestmark = pytest.mark.slow  # torchrun starts two training processes

TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--local-addr",  # the default, the host name, need not resolve (CI's does not)
    "127.0.0.1",
    "--nproc-per-node",
    "2",
]
STOP_AT = """
import sys
from pellucid.train import ddp
from pellucid.train.config import TrainConfig
from pellucid.train.trainer import Trainer
trainer = Trainer(TrainConfig(**eval(sys.argv[1])), verbose=False)
trainer.run(stop_at=int(sys.argv[2]))
ddp.shutdown(trainer.dist)
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fsdp")
    (folder / "t.txt").write_text(tiny_text())
    prepare([str(folder / "t.txt")], "char", folder / "data")
    return folder / "data"


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The run's trained weights, gathered in this process from whatever checkpoint it wrote."""
    ckpt = load_checkpoint(run)
    if "sharded" not in ckpt:
        return ckpt["model"]
    model = build_model(ModelConfig(**ckpt["model_config"]))
    fsdp.load_model_state(model, Path(ckpt["sharded"]))
    return model.state_dict()


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_sharded_processes_match_one_and_export(data: Path, tmp_path: Path):
    # grad_accum 2: the first micro-step of each step skips the gradients' reduce-scatter
    cfg = tiny_config(data, tmp_path / "one", max_iters=8, eval_interval=4, dtype="float32")
    cfg = replace(cfg, grad_accum=2, batch_size=6)
    one = Trainer(cfg, verbose=False).run()
    two = tmp_path / "two"
    proc = run(
        [
            *TORCHRUN,
            "-m",
            "pellucid",
            "train",
            *cli_args(replace(cfg, fsdp=True)),
            "--out",
            str(two),
        ]
    )
    assert "2 process(es), sharded (FSDP2)" in proc.stderr
    ckpt = load_checkpoint(two)
    assert "sharded" in ckpt and ckpt["step"] == 8
    losses = [loss for _, loss in ckpt["history"]["train"]]
    assert losses == pytest.approx(one.train_losses, rel=1e-5)
    ours = weights(two)
    for name, tensor in weights(tmp_path / "one").items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)
    from pellucid import LLM

    llm = LLM(two / "model", dtype="float32")  # exported from the shards at the end
    ids = llm.encode("The king")
    model = build_model(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ours)
    with torch.no_grad():
        expected = model.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(llm.logits(ids), expected, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_of_two_ranks_resumes_on_one(data: Path, tmp_path: Path):
    cfg = tiny_config(data, tmp_path / "split", max_iters=8, eval_interval=4, dtype="float32")
    cfg = replace(cfg, fsdp=True)
    script = tmp_path / "stop_at.py"
    script.write_text(textwrap.dedent(STOP_AT))
    run([*TORCHRUN, str(script), repr(cfg.to_dict()), "4"])
    assert load_checkpoint(tmp_path / "split")["step"] == 4
    resumed = Trainer(cfg, resume=True, verbose=False).run()  # one process, no process group
    straight = Trainer(replace(cfg, out=str(tmp_path / "straight"), fsdp=False), verbose=False)
    full = straight.run()
    assert resumed.train_losses == pytest.approx(full.train_losses, rel=1e-5)
    ours = weights(tmp_path / "split")
    for name, tensor in weights(tmp_path / "straight").items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)


KILL_DURING_SAVE = """
import os, signal, sys
from pellucid.train import fsdp
from pellucid.train.config import TrainConfig
from pellucid.train.trainer import Trainer
saves = 0
real = fsdp._fsync_tree
def fsync_tree(folder):
    # The second save: every shard and the facts are written, the link not yet moved. Die here.
    global saves
    saves += 1
    if saves == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(folder)
fsdp._fsync_tree = fsync_tree
Trainer(TrainConfig(**eval(sys.argv[1])), verbose=False).run()
"""


def test_sigkill_during_a_sharded_save_then_resume(data: Path, tmp_path: Path):
    cfg = tiny_config(data, tmp_path / "killed", ckpt_interval=5, fsdp=True, dtype="float32")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILL_DURING_SAVE), repr(cfg.to_dict())],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    folders = sorted(p.name for p in (tmp_path / "killed").glob("ckpt-*.dcp"))
    assert len(folders) == 2  # the one linked and the one cut off
    assert load_checkpoint(tmp_path / "killed")["step"] == 5  # the previous save is intact
    resumed = Trainer(cfg, resume=True, verbose=False).run()
    full = Trainer(replace(cfg, out=str(tmp_path / "full")), verbose=False).run()
    assert resumed.train_losses == full.train_losses
    assert len(list((tmp_path / "killed").glob("ckpt-*.dcp"))) == 1  # the next save tidied up


def test_two_nodes_of_one_process_each(data: Path, tmp_path: Path):
    """Multi-node as a cluster runs it (static rendezvous: the node ranks and the address of
    node 0), the two "nodes" being two torchrun launchers on this machine."""
    cfg = tiny_config(data, tmp_path / "one", max_iters=4, eval_interval=4, dtype="float32")
    one = Trainer(cfg, verbose=False).run()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = [*cli_args(replace(cfg, fsdp=True)), "--out", str(tmp_path / "nodes"), "--no-export"]
    launchers = [
        subprocess.Popen(
            [
                *TORCHRUN[:3],  # python -m torch.distributed.run
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "pellucid",
                "train",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for launcher in launchers:
        _, err = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, err[-3000:]
    losses = [loss for _, loss in load_checkpoint(tmp_path / "nodes")["history"]["train"]]
    assert losses == pytest.approx(one.train_losses, rel=1e-5)


def test_a_missing_shard_is_refused_by_name(data: Path, tmp_path: Path):
    cfg = tiny_config(data, tmp_path / "run", max_iters=2, fsdp=True, dtype="float32")
    Trainer(cfg, verbose=False).run()
    folder = Path(load_checkpoint(tmp_path / "run")["sharded"])
    for shard in folder.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(ValueError, match="sharded checkpoint cannot be read.*shard is missing"):
        Trainer(cfg, resume=True, verbose=False)
