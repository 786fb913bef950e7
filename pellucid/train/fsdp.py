"""Sharded training: `torchrun --nproc-per-node N -m pellucid train ... --fsdp`.

FSDP2 (`fully_shard`) gives each rank 1/N of every parameter, gradient and optimizer state: each
block is a unit whose weights are gathered just before it runs and freed after, and whose
gradients are averaged and scattered back in shards (the root holds the embeddings, the tied head
and the final norm). Ranks still train on their own rows of one global batch, as with DDP, so N
processes take the steps one process takes.

Checkpoints are sharded too (`torch.distributed.checkpoint`): every rank writes its shards into
`OUT/ckpt-N.dcp/` (numbered in the order written), rank 0 adds the run's facts (`meta.pt`: step, RNG states, history,
config) and then points the link `OUT/ckpt.dcp` at the new folder in one atomic rename, so a run
killed mid-save resumes from the one before. A checkpoint loads on any number of ranks (one
included, without FSDP): the library reshards it.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from pellucid.train.ddp import DistInfo

LINK = "ckpt.dcp"  # points at the newest complete checkpoint folder
META = "meta.pt"
_FOLDER = re.compile(r"ckpt-\d+\.dcp")


def shard(model: nn.Module, info: DistInfo) -> nn.Module:
    """Each block its own FSDP unit, then the root (embeddings, final norm, head); in place."""
    if info.world == 1:
        return model  # nothing to share out: the plain model, still saved as shards
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Skip the gradient reduce-scatter on micro-steps before the last one of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def full(x: Tensor) -> Tensor:
    """A sharded value (a DTensor: the gradient norm) as one ordinary tensor."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def save(model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, out: Path) -> Path:
    """Every rank's shards, then the facts, then the link: the checkpoint folder it points at.
    Collective: every rank calls it."""
    folder = out / _next_name(out)
    model_state, optim_state = get_state_dict(model, optimizer)
    with _one_process_meant():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    if _is_main():
        torch.save(meta, folder / META)
        _fsync_tree(folder)
        link = out / f".{LINK}.new-{os.getpid()}"
        link.unlink(missing_ok=True)
        link.symlink_to(folder.name)
        os.replace(link, out / LINK)  # the switch: one atomic rename
        for old in out.iterdir():
            if _FOLDER.fullmatch(old.name) and old.name != folder.name:
                shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # no rank runs on (or exits) before the checkpoint is whole
    return folder


def load_meta(out: Path) -> dict[str, Any] | None:
    """The facts of the checkpoint `OUT/ckpt.dcp` points at, with its folder under "sharded";
    None when there is no sharded checkpoint."""
    link = out / LINK
    if not link.is_symlink():
        return None
    folder = out / os.readlink(link)
    if not (folder / META).is_file():
        raise ValueError(f"{link}: its folder {folder} is missing or incomplete")
    meta = torch.load(folder / META, map_location="cpu", weights_only=True)
    return {**meta, "sharded": str(folder)}


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load the shards into this run's model and optimizer, however many ranks wrote them."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        with _one_process_meant():
            dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # several kinds, for missing or torn shards
        raise ValueError(
            f"{folder}: the sharded checkpoint cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no detail'}); a shard is missing or "
            "damaged. Nothing was changed: restore the folder, or train from scratch"
        ) from e
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def load_model_state(model: nn.Module, folder: Path) -> None:
    """Only the weights, into a plain model in this one process (for export)."""
    state = {"model": model.state_dict()}
    with _one_process_meant():
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(state["model"])


def _next_name(out: Path) -> str:
    """The next number after every checkpoint folder there (a killed save's too), the same on
    every rank: rank 0 picks it."""
    name = [""]
    if _is_main():
        out.mkdir(parents=True, exist_ok=True)
        found = [int(p.name[5:-4]) for p in out.iterdir() if _FOLDER.fullmatch(p.name)]
        name[0] = f"ckpt-{max(found, default=-1) + 1:06d}.dcp"
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


@contextmanager
def _one_process_meant() -> Iterator[None]:
    """Without a process group, the library says it assumes one process: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _fsync_tree(folder: Path) -> None:
    """The shards and facts reach the disk before the link names them."""
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
