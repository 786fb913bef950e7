"""setup_process: what a training process sets for itself, once, before it builds anything: its
place among torchrun's processes, its threads, and a heap that keeps what each step frees."""

from __future__ import annotations

import os

import torch

from pellucid.malloc import keep_freed_memory
from pellucid.train import ddp
from pellucid.train.config import TrainConfig


def setup_process(cfg: TrainConfig) -> ddp.DistInfo:
    dist = ddp.init_distributed(cfg.batch_size)
    keep_freed_memory()  # each step frees what the next one allocates again
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    elif dist.world > 1:  # N processes x all cores each would oversubscribe the machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.world))
    return dist
