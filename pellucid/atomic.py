"""atomic_path: write a file or folder beside its final name, then rename it into place, so that a
reader, or a run killed halfway, sees the old version or the whole new one, never half of one.

    with atomic_path(run / "ckpt.pt", durable=True) as tmp:
        torch.save(state, tmp)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL = ".{}.partial-"  # + the writer's pid (+ the final suffix): `.ckpt.pt.partial-4242.pt`


@contextmanager
def atomic_path(final: Path, *, folder: bool = False, durable: bool = False) -> Iterator[Path]:
    """A fresh temporary path next to `final` (a file, or with `folder` an empty folder) to
    write; when the block ends without error it replaces `final`, else it is removed.
    `durable`: the bytes and the rename reach the disk before this returns (a power cut then
    keeps one of the two versions)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(final)
    # one per process, so that two processes writing the same file do not mix their bytes; the
    # suffix stays, for writers that choose a format by it (matplotlib)
    tmp = final.with_name(f"{PARTIAL.format(final.name)}{os.getpid()}{final.suffix}")
    _remove(tmp)
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        if durable:
            _fsync(tmp)
        _replace(tmp, final, folder)
        if durable:
            _fsync(final.parent)
    finally:
        _remove(tmp)


def _remove_orphans(final: Path) -> None:
    """Partial writes left by processes that were killed mid-write (a checkpoint under SIGKILL)."""
    for tmp in final.parent.glob(PARTIAL.format(final.name) + "*"):
        pid = tmp.name[len(PARTIAL.format(final.name)) :].removesuffix(final.suffix)
        if pid.isdigit() and not _alive(int(pid)):
            _remove(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _replace(tmp: Path, final: Path, folder: bool) -> None:
    if not folder or not final.exists():
        os.replace(tmp, final)  # a file over a file is one atomic rename
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    final.rename(old)  # a folder cannot replace a folder in one step: the old one steps aside
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
