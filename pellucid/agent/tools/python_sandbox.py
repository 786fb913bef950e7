"""The `python` tool: run model-written code in a child `python -I` confined to a fresh temp dir.

Layers, each enough for the tests alone: an audit hook, installed before the code runs, refuses
sockets, subprocesses, signals, ctypes, files outside the temp dir (Python's own: read only) and
the introspection that could switch it off; where the kernel allows, Landlock enforces the same
file rules, and user+network+PID namespaces (`unshare`) cut the network and other processes off;
rlimits and a wall-clock kill of the process group bound time, memory and output.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from .tool import Tool, ToolError, tool

_MAX_CHARS = 4000
_FILE_LIMIT_MB = 64  # RLIMIT_FSIZE: the largest file the code may write, output files included

# The child's bootstrap, run as `python -c` text (see sandbox_child.py for why it is built so)
_CHILD = Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")


def make_python_tool(timeout_s: float = 10, memory_mb: int = 512) -> Tool:
    """A "python" tool that runs code in a sandbox with these wall-clock and memory limits."""
    if timeout_s <= 0 or memory_mb < 64:
        raise ValueError(f"need timeout_s > 0 and memory_mb >= 64, got {timeout_s}, {memory_mb}")

    @tool(name="python")
    def python(code: str) -> str:
        """Run a Python 3 program and return what it prints (stdout, then stderr).

        Args:
            code: The program. Print the results you need. There is no network and no
                subprocesses; only the current directory is writable, and it is deleted after
                the run.
        """
        return run_sandboxed(code, timeout_s, memory_mb)

    python.description += f" Limits: {timeout_s:g} s, {memory_mb} MB; no network; no files kept."
    return python


def run_sandboxed(
    code: str,
    timeout_s: float = 10,
    memory_mb: int = 512,
    *,
    kernel_layers: bool = True,
    audit_hook: bool = True,
) -> str:
    """Run `code` as main.py in a fresh temp dir; its output, or a ToolError on a timeout.

    The two switches exist for tests, which show that each layer holds without the other.
    """
    with (
        tempfile.TemporaryDirectory(prefix="pellucid-python-", ignore_cleanup_errors=True) as tmp,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
    ):
        Path(tmp, "main.py").write_text(code, encoding="utf-8")
        limits = [memory_mb, math.ceil(timeout_s) + 1, _FILE_LIMIT_MB, kernel_layers, audit_hook]
        python = [sys.executable, "-I", "-B", "-u", "-X", "utf8", "-c", _CHILD]
        argv = [*(_namespaces() if kernel_layers else ()), *python, *map(str, map(int, limits))]
        # Output goes to files, not pipes: RLIMIT_FSIZE bounds them, and nothing must drain them.
        child = subprocess.Popen(
            argv,
            cwd=tmp,
            env=_environment(tmp),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group, killed whole on a timeout
        )
        try:
            status = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            if child.poll() is None:  # a timeout, or an interrupt of this process
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        out, err = _read(stdout), _read(stderr)
    if status is None:
        partial = _clip(out + err)
        raise ToolError(
            f"python: killed after {timeout_s:g} s (wall-clock timeout); make the program "
            "faster or smaller" + (f". Output so far:\n{partial}" if partial else "")
        )
    return _clip(_report(out, err, status))


def _report(out: str, err: str, status: int) -> str:
    text = out + (f"\n[stderr]\n{err}" if out and err else err)
    if status < 0:
        name = signal.Signals(-status).name
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (memory or CPU limit)"}.get(name, "")
        text += f"\n[killed by {name}{why}]"
    elif status > 0:
        text += f"\n[exit status {status}]"
    return text.strip("\n") or "(no output; print the values you need)"


def _read(file: IO[bytes]) -> str:
    """The head and the tail of an output file (a runaway print loop can write megabytes)."""
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    head = file.read(4 * _MAX_CHARS)
    if size > 8 * _MAX_CHARS:
        file.seek(size - 4 * _MAX_CHARS)
        head += b"\n" + file.read()
    elif size > 4 * _MAX_CHARS:
        head += file.read()
    return head.decode("utf-8", errors="replace")


def _clip(text: str) -> str:
    if len(text) <= _MAX_CHARS:
        return text
    cut = len(text) - _MAX_CHARS
    return f"{text[:2500]}\n[... {cut} characters cut ...]\n{text[-1500:]}"


def _environment(tmp: str) -> dict[str, str]:
    # -I ignores PYTHON* variables; the BLAS ones keep numpy from starting threads it may not have.
    threads = dict.fromkeys(("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"), "1")
    return {"HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PATH": os.defpath} | threads


@functools.cache
def _namespaces() -> tuple[str, ...]:
    """An `unshare` prefix for fresh user, network and PID namespaces, if this kernel allows it.

    The network namespace has no interfaces up, and in the PID namespace no process outside is
    visible, so neither a hook bypass nor a C extension can reach the network or signal anyone.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in (("--net", "--pid", "--fork", "--kill-child"), ("--net",)):
        argv = (unshare, "--user", "--map-root-user", *flags)
        try:
            probe = subprocess.run([*argv, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return argv
    return ()


@functools.cache
def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers (0: none), i.e. whether file access is also
    enforced by the kernel rather than by the audit hook alone."""
    import ctypes  # here only: the sandboxed child imports its own

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(int(libc.syscall(444, None, 0, 1)), 0)
