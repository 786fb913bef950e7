"""Shared benchmark plumbing: repeat and summarize timings, describe the machine, save results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# Sampled workloads: the model's recommended sampling where it sets these (pellucid's
# `LLM.sampling_defaults`, what its server uses), else each one off, given alike to every engine
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
# A model measured without a decode step compiled ahead is measured eagerly, as reported: no
# build of one in the background (pellucid/engine/aot_build.py) beside the measurement
os.environ.setdefault("PELLUCID_BUILD_AHEAD", "0")


def repeat(fn: Callable[[], float], n: int) -> dict[str, object]:
    """Run fn n times (it returns one measured value) -> median / min / max, and the values."""
    return summarize([fn() for _ in range(n)])


def summarize(values: list[float]) -> dict[str, object]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": [round(v, 3) for v in values],
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_rss_mib() -> float:
    """This process's own peak resident memory. Linux's VmHWM, not getrusage's ru_maxrss: a
    process started by fork + exec inherits in ru_maxrss the parent's size at the fork, so every
    engine a benchmark starts in a child reported the benchmark's own peak (one run showed 1,651
    MiB for pellucid and llama.cpp alike)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024  # KiB
    except (OSError, IndexError):  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict[str, object]:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "isa": isa_flags(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),  # set: oneDNN capped (no AMX)
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def isa_flags() -> list[str]:
    """The vector and matrix extensions this CPU reports (of those the kernels here can use).
    pellucid.cpu has the same reader; a peer's process must not import pellucid (and torch with
    it), or its peak RSS would count torch's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in ISA if f in flags]
    except OSError:
        pass
    return []


def machine_tag(cpu: str, isa: list[str], onednn_cap: str | None = None) -> str:
    """A short name for the CPU's family, for result file names: results are kept per machine.
    A CPU without AVX-512 is marked so ("AMD EPYC" names both kinds), and so is a run with
    oneDNN capped by ONEDNN_MAX_CPU_ISA (an AMX Xeon measured as one without AMX)."""
    lowered, tag = cpu.lower(), "cpu"
    for vendor, family in (("amd", "epyc"), ("intel", "xeon")):
        if vendor in lowered or family in lowered:
            tag = f"{vendor}-{family}" if family in lowered else vendor
            break
    tag = tag if "avx512f" in isa else f"{tag}-avx2"
    return tag if not onednn_cap else f"{tag}-{onednn_cap.lower().replace('_', '-')}"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False, cwd=Path(__file__).parent,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def save(name: str, result: dict[str, object]) -> Path:
    """Write the result with commit, machine and date to benchmarks/results/ and print it."""
    stamp = datetime.now(UTC)
    result = {
        "benchmark": name,
        "date": stamp.isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        **result,
    }
    RESULTS.mkdir(exist_ok=True)
    host = result["machine"]
    tag = machine_tag(str(host["cpu"]), list(host["isa"]), host["onednn_max_cpu_isa"])
    path = RESULTS / f"{stamp:%Y-%m-%d}-{name}-{result['model']}-{tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))  # the last line is one JSON object
    return path


def hf_peer(model_path: str | Path):
    """Hugging Face transformers' model for the same GGUF file (fp32, dequantized by transformers),
    or None with the reason on stderr: the peer is optional. Needs `accelerate` (`make bench`)."""
    import sys

    import torch

    try:
        from transformers import AutoModelForCausalLM

        path = Path(model_path)
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"transformers peer skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def recommended_sampling(defaults: dict[str, float]) -> dict[str, float]:
    """SAMPLING's settings as a model's recommended ones (`LLM.sampling_defaults`) set them."""
    return {k: defaults.get(k, off) for k, off in SAMPLING.items()}
