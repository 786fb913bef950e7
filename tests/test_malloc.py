"""pellucid.malloc: freed heap memory given back to the OS after loading."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import pytest

from pellucid.malloc import release_freed_memory


def _anonymous_mib() -> float:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"^Anonymous:\s+(\d+)", rollup, re.MULTILINE).group(1)) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_memory_freed_below_a_live_block_goes_back_to_the_os():
    """What a tokenizer's parse leaves: many small blocks freed under one still in use at the
    heap's top, which glibc does not give back by itself."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4000) for _ in range(25_000)]  # ~100 MB, below mmap's threshold
    for b in blocks:
        ctypes.memset(b, 1, 4000)
    for b in blocks[:-1]:
        libc.free(b)
    before = _anonymous_mib()
    assert release_freed_memory()
    after = _anonymous_mib()
    libc.free(blocks[-1])
    assert before - after > 50, (before, after)
