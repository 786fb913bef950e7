"""What this CPU can do, read once from /proc/cpuinfo: the kernels pick their path by it
(fbgemm only with VNNI, bf16 only where it is native), packages compiled ahead are keyed by it,
and every benchmark result records it."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# The vector and matrix extensions the kernels here can use, in the order results list them.
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@functools.cache
def _first_processor() -> dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """Every flag of the first processor in /proc/cpuinfo; empty where there is none."""
    return frozenset(_first_processor().get("flags", "").split())


def cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it, else the machine type."""
    return _first_processor().get("model name") or platform.machine()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16 or AMX). Elsewhere
    oneDNN emulates them: on an AVX2 EPYC a 1024^3 bf16 matmul ran at 0.8 GFLOP/s against
    97 in float32, so there the fast path's dense matrices and training's autocast use float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def onednn_amx() -> bool:
    """Whether oneDNN's GEMMs use AMX tiles here: the CPU has them and ONEDNN_MAX_CPU_ISA, if
    set, does not keep oneDNN below them (e.g. AVX512_CORE_BF16, how the non-AMX case is
    measured on an AMX machine)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return "amx_bf16" in cpu_flags() and (cap in ("ALL", "DEFAULT") or "AMX" in cap)


def matmul_float() -> str:
    """The float type for matrix work here: "bfloat16" where native, else "float32" (training's
    default autocast)."""
    return "bfloat16" if native_bf16() else "float32"


def isa_flags() -> list[str]:
    """Of ISA, those this CPU has."""
    return [f for f in ISA if f in cpu_flags()]
