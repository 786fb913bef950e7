"""The decode step compiled ahead for a model that has none yet, built in a background process.

Why: a model a user brings (their own GGUF, or Gemma from the catalog) has no package until
`pellucid compile --model M` builds one, and without it every token is decoded eagerly, several
times slower, below llama.cpp's speed (benchmarks/results/comments.md). A user who never hears
of `pellucid compile` should not pay that on every run. So the first fast-path load
of such a model starts that command in a process of its own, at a low priority: this process
serves eagerly meanwhile (no request waits for the compiler), switches to the package once it
is written (compiled_decode.py looks for it), and every later process loads it at once.

The build outlives the process that started it (a one-shot `pellucid generate` ends in
seconds; the next run finds the package). A lock file beside the package holds the builder's
pid: one build at a time per package, and a build that ended without writing its package
(no C++ compiler, an unsupported op) is not started again; its log says why.
`EngineConfig(build_ahead=False)`, or PELLUCID_BUILD_AHEAD=0, turns this off.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("pellucid")
NICE = 19  # the lowest priority: a server decoding beside the build runs as if it were alone


def lock_of(package: Path) -> Path:
    return package.with_suffix(".building")


def log_of(package: Path) -> Path:
    return package.with_suffix(".log")


def command(model_path: Path) -> list[str]:
    """The build: `pellucid compile` of the few-row package (the steps of a request alone), at
    niceness NICE (set by the child itself: a function run between fork and exec is unsafe in
    a process with threads, as this one has)."""
    start = f"import os, sys; os.nice({NICE}); from pellucid.cli import main; sys.exit(main())"
    return [sys.executable, "-c", start, "compile", "--model", str(model_path),
            "--kind", "few-rows"]  # fmt: skip


def start(model_path: Path, package: Path) -> bool:
    """Start building `package` for the model at `model_path` unless it exists, is being built,
    or a build of it failed: True while a build may still write it (this call's or another's)."""
    lock = lock_of(package)
    if package.exists():
        lock.unlink(missing_ok=True)  # its build's, which has ended
        return False
    if lock.exists():
        if builder_alive(lock):
            return True
        log.warning(
            "a background build of the compiled decode step ended without it (see %s); "
            "decoding eagerly: run `pellucid compile --model %s` to build it", log_of(package),
            model_path,
        )  # fmt: skip
        return False
    package.parent.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: of two processes starting at once, one builds
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return True
    try:
        with open(log_of(package), "wb") as out:
            builder = subprocess.Popen(
                command(model_path), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT,
                # a group of its own: a ^C here does not stop it. Not a session of its own: Linux
                # shares the CPU between sessions (autogroups) before it weighs niceness: the
                # build then took half of it, and the decoding beside it slowed several times
                process_group=0, env=os.environ | {"PELLUCID_BUILD_AHEAD": "0"},
            )  # fmt: skip
    except OSError as e:
        os.close(fd)
        lock.unlink()
        log.warning("could not start building the compiled decode step (%s); decoding eagerly", e)
        return False
    os.write(fd, str(builder.pid).encode())
    os.close(fd)
    log.warning(
        "no decode step compiled ahead for this model yet: building it in the background "
        "(pellucid compile, 2-4 minutes once; log %s); decoding eagerly until it is ready",
        log_of(package),
    )
    return True


def builder_alive(lock: Path) -> bool:
    """Whether the process named in the lock file still runs (an empty file: it is being
    written by the process that just made it, unless that was a while ago)."""
    text = lock.read_text().strip()
    if not text:
        return time.time() - lock.stat().st_mtime < 60
    try:
        pid = int(text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):  # a damaged file; a process that has ended
        return False
    except PermissionError:  # another user's process
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A child of this process that has ended but not been reaped still answers os.kill."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: its parent reaps it
        return False
    return done == pid
