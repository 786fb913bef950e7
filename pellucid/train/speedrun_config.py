"""What `pellucid speedrun` is asked to do (SpeedrunConfig), its stages in order, and what each
finished stage wrote down about itself (OUT/STAGE/stage.json), which the report reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pellucid.errors import PellucidError

STAGES = ("corpus", "tokenizer", "data", "sizing", "pretrain", "chat", "gguf", "report")
DONE = "stage.json"


class SpeedrunError(PellucidError):
    """A stage could not run: what is missing or wrong, and that a rerun continues."""


@dataclass(slots=True)
class SpeedrunConfig:
    out: Path
    minutes: float = 35.0  # pre-training's wall time on this machine: its compute budget
    vocab_size: int = 8192
    block_size: int = 512  # the model's context
    batch_size: int = 16  # rows a pre-training step
    tokenizer_chars: int = 20_000_000  # of the corpus the BPE merges are learned from
    max_chars: int | None = None  # of pre-training text (None: all, ~63M characters)
    sft_chats: int = 2000
    held_out_chats: int = 50
    sft_epochs: int = 2
    sft_lr: float = 3e-4
    compare: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")
    tasks: tuple[str, ...] = (
        "bigbench:hindu_knowledge",
        "bigbench:linguistic_mappings/plural_irregular_json",
    )
    eval_bytes: int = 100_000  # of each held-out text scored in bits per byte
    seed: int = 0
    sweep: dict = field(default_factory=lambda: {"batch_size": 4, "block_size": 256})

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.minutes <= 0 or self.sft_chats < 1 or self.held_out_chats < 1:
            raise SpeedrunError("minutes > 0, sft_chats >= 1 and held_out_chats >= 1 please")


Log = Callable[[str], None]


def stage_facts(out: Path, name: str) -> dict:
    return json.loads((out / name / DONE).read_text())
