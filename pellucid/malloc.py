"""When the memory the process frees goes back to the OS: kept for its next use while training,
given back at once after loading a model.

glibc gives the top of the heap back once more than 128 KiB of it is free, so every training
step (whose activations and gradients are freed at its end) faults the same pages in again, one
zero-filled page at a time: a sizeable part of a small model's step
(benchmarks/results/comments.md).
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_TOP_PAD = -1, -2  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(trim_threshold: int = 1 << 30, top_pad: int = 64 << 20) -> bool:
    """Trim the heap only past `trim_threshold` free bytes and grow it `top_pad` bytes at a time.
    True if set; False where the C library is not glibc (macOS, musl), which changes nothing."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, trim_threshold)) and bool(mallopt(M_TOP_PAD, top_pad))


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the OS now (glibc's malloc_trim). For after loading:
    parsing a large tokenizer (Gemma 3's 262k tokens and 515k merges, as JSON) frees memory that
    glibc would otherwise keep, counted in the process's memory for as long as it runs. False
    where the C library is not glibc."""
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


def _glibc(name: str) -> ctypes._CFuncPtr | None:
    """glibc's function `name`, or None where this is not Linux with glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
