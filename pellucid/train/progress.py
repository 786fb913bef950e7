"""Training progress for people: a live bar on a terminal, plain log lines elsewhere (files, CI)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(
        self,
        total: int,
        start: int,
        log_every: int,
        enabled: bool = True,
        write: Callable[[str], None] | None = None,
    ):
        self.log_every = log_every
        self.enabled = enabled
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.bar: Progress | None = None
        if enabled and sys.stderr.isatty():
            self.bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("", total=total, completed=start)
            self.bar.start()

    def step(self, step: int, line: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, description=line)
        elif self.enabled and step % self.log_every == 0:
            self.write(f"step {step} | {line}")

    def note(self, line: str) -> None:
        """A line that stays (evaluations, samples, checkpoints)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            self.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
