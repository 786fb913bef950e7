"""Export a training run: an HF folder (hf_export.py), or a GGUF file when the name ends in .gguf
(gguf_export.py).

    pellucid export runs/baby --out models/baby          # or --out models/baby.gguf
"""

from __future__ import annotations

from pathlib import Path

from pellucid.models import build_model
from pellucid.models.config import ModelConfig
from pellucid.train import fsdp
from pellucid.train.checkpoint import load_checkpoint
from pellucid.train.gguf_export import export_gguf
from pellucid.train.hf_export import export_hf


def export_checkpoint(run: Path, out: Path) -> Path:
    """A training run folder (its ckpt.pt and data folder's tokenizer) -> an HF model folder,
    or a GGUF file when `out` ends in .gguf."""
    ckpt = load_checkpoint(run)
    cfg = ModelConfig(**ckpt["model_config"])
    model = build_model(cfg)
    if "sharded" in ckpt:  # written by FSDP ranks: gathered here, in one process
        fsdp.load_model_state(model, Path(ckpt["sharded"]))
    else:
        model.load_state_dict(ckpt["model"])
    # the run folder holds a copy of the tokenizer; older runs only name their data folder
    tokenizer = run if (run / "tokenizer.json").is_file() else Path(ckpt["config"]["data"])
    if out.suffix == ".gguf":
        return export_gguf(model, tokenizer, out)
    return export_hf(model, tokenizer, out)
