"""Training checkpoints: written whole to a temporary file, then renamed over the old one.

A rename within one folder is atomic, so a crash (even SIGKILL) mid-save leaves the previous
checkpoint intact plus a stray `*.tmp` that the next save overwrites: `ckpt.pt` is never half
written. It holds the model, optimizer, RNG states, data position and loss history, which is what
`--resume` needs to continue exactly where it stopped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "ckpt.pt"


def save_checkpoint(state: dict[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    final, tmp = folder / CHECKPOINT, folder / f"{CHECKPOINT}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes reach the disk before the name points at them
    os.replace(tmp, final)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # and the rename itself survives a power cut
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(folder: Path) -> dict[str, Any]:
    path = folder / CHECKPOINT if folder.is_dir() else folder
    if not path.is_file():
        raise ValueError(f"{path}: no checkpoint to resume from; train without --resume first")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged files
        raise ValueError(f"{path}: the checkpoint cannot be read ({e})") from e
