"""What this CPU can do, read once from /proc/cpuinfo: the kernels pick their path by it
(fbgemm's 7-bit activations without VNNI), packages compiled ahead are keyed by it, and every
benchmark result records it."""

from __future__ import annotations

import functools
from pathlib import Path

# The vector and matrix extensions the kernels here can use, in the order results list them.
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """Every flag of the first processor in /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


def isa_flags() -> list[str]:
    """Of ISA, those this CPU has."""
    return [f for f in ISA if f in cpu_flags()]
