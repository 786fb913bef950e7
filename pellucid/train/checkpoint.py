"""Training checkpoints: written whole to a temporary file, then renamed over the old one.

A rename within one folder is atomic, so a crash (even SIGKILL) mid-save leaves the previous
checkpoint intact plus a partial file that the next save removes: `ckpt.pt` is never half
written. It holds the model, optimizer, RNG states, data position and loss history, which is what
`--resume` needs to continue exactly where it stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pellucid.atomic import atomic_path
from pellucid.train import fsdp

CHECKPOINT = "ckpt.pt"


def save_checkpoint(state: dict[str, Any], folder: Path) -> Path:
    final = folder / CHECKPOINT
    with atomic_path(final, durable=True) as tmp:
        torch.save(state, tmp)
    return final


def load_checkpoint(folder: Path) -> dict[str, Any]:
    """A run's checkpoint: ckpt.pt whole, or a sharded one's facts with its folder under
    "sharded" (fsdp.py; its tensors load into a model and optimizer from there)."""
    if folder.is_dir():
        sharded = fsdp.load_meta(folder)
        if sharded is not None:
            return sharded
    path = folder / CHECKPOINT if folder.is_dir() else folder
    if not path.is_file():
        raise ValueError(f"{path}: no checkpoint to resume from; train without --resume first")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged files
        raise ValueError(f"{path}: the checkpoint cannot be read ({e})") from e
