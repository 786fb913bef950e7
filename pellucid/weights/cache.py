"""A disk cache of converted GGUF checkpoints, so the second load of a file is fast.

Reading a GGUF's metadata with the gguf package takes seconds (a 49k- or 262k-entry vocabulary is
read field by field), and so does dequantizing its tensors. The first load stores what they
produce, the metadata as JSON and the float32 tensors under our module names as safetensors, in
`~/.cache/pellucid/checkpoints/<name>-<key>/`; later loads read that instead, several times
faster (load times: README, benchmarks/results/). The key covers the file's path, size and
modification time and CACHE_VERSION, so an edited file or a changed conversion misses; storing a
new entry deletes the older ones of the same file at the same path, so reinstalls do not pile up
(an entry is the float32 model: 0.5 GB for SmolLM2, 1.1 GB for Gemma 3 270M; the int4 fast path
adds its packed weights, so that its loads never build the float32 model at all). A copy of the
file at another path keeps an entry of its own. `PELLUCID_CACHE_DIR` moves the cache;
`PELLUCID_NO_CACHE=1` turns it off. The cache only speeds loads up: any problem with it means a
normal load, never a failed one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from pellucid.atomic import atomic_path

CACHE_VERSION = 3  # bump when gguf_state_dict or the metadata reading changes what it returns
SOURCE = "source.txt"  # in each entry: the path of the file it was converted from


def cache_root() -> Path:
    """$PELLUCID_CACHE_DIR, else $XDG_CACHE_HOME/pellucid, else ~/.cache/pellucid (as tokenizers)."""
    if os.environ.get("PELLUCID_CACHE_DIR"):
        return Path(os.environ["PELLUCID_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pellucid"


def _source(entry: Path) -> str | None:
    """The file an entry was converted from (None: an entry from before this was recorded)."""
    try:
        return (entry / SOURCE).read_text()
    except OSError:
        return None


def entry_dir(path: Path) -> Path | None:
    """Where `path`'s converted checkpoint lives, or None when caching is off."""
    if os.environ.get("PELLUCID_NO_CACHE") == "1":
        return None
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root() / "checkpoints" / f"{path.stem}-{digest}"


def load(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
    """(metadata, float32 state) of a GGUF file converted before, or None."""
    metadata = load_metadata(path)
    where = entry_dir(path)
    if metadata is None or where is None or not (where / "model.safetensors").is_file():
        return None
    try:
        return metadata, load_file(where / "model.safetensors")
    except Exception:  # noqa: BLE001 - a damaged file is a miss; the next store replaces it
        return None


def load_metadata(path: Path) -> dict[str, Any] | None:
    where = entry_dir(path)
    try:
        return None if where is None else json.loads((where / "metadata.json").read_text())
    except Exception:  # noqa: BLE001 - a missing or damaged entry is a miss
        return None


def load_packed(path: Path, name: str) -> dict[str, Tensor] | None:
    """The packed fast-path model stored as `name`.pt, memory-mapped, or None.

    torch's own format, not safetensors: it aligns each tensor to 64 bytes, so the int8/int4
    kernels can read the mapped file in place (safetensors' offsets, 24 mod 64 here, crash the
    int8 kernel), and pages are read only as they are used.
    """
    where = entry_dir(path)
    if where is None or not (where / f"{name}.pt").is_file():
        return None
    try:
        return torch.load(where / f"{name}.pt", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - a damaged file is a miss; the next store replaces it
        return None


def store_packed(path: Path, name: str, state: dict[str, Tensor]) -> None:
    """Add the packed model to `path`'s existing entry (written aside, then renamed).

    Its pages are then dropped from the page cache: pages a write leaves there, mapped by a
    later load, came into the process in far larger runs than pages read by its own faults
    (Gemma 3's embedding table: 25.7 MB mapped for one pre-fill against 2.9 MB;
    benchmarks/results/comments.md), and the first loads after packing showed that as resident
    memory (peak RSS 894 MiB against 710)."""
    where = entry_dir(path)
    if where is None or not (where / "metadata.json").is_file():
        return
    try:
        with atomic_path(where / f"{name}.pt", durable=True) as tmp:  # durable: clean pages
            torch.save({k: v.contiguous() for k, v in state.items()}, tmp)
        drop_from_page_cache(where / f"{name}.pt")
    except (OSError, RuntimeError):
        pass  # a full disk or read-only home: the next load packs again


def drop_from_page_cache(file: Path) -> None:
    """Ask the kernel to drop a file's clean pages from the page cache (where it can)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store(path: Path, metadata: dict[str, Any], state: dict[str, Tensor]) -> None:
    """Keep the converted checkpoint; written to a temporary folder, then renamed into place."""
    where = entry_dir(path)
    if where is None:
        return
    try:
        with atomic_path(where, folder=True) as tmp:  # replaces a damaged entry of the same key
            (tmp / "metadata.json").write_text(json.dumps(metadata))
            save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
            (tmp / SOURCE).write_text(str(path.resolve()))
        # The same file before an edit or a reinstall goes; a copy at another path (a second
        # virtual environment installing the same model) keeps its entry, or the two would
        # evict each other and every other load would convert the file again.
        for stale in where.parent.glob(f"{path.stem}-*"):
            if stale != where and _source(stale) in (None, str(path.resolve())):
                shutil.rmtree(stale, ignore_errors=True)
    except (OSError, TypeError, ValueError):  # a full disk, a read-only home, odd metadata
        pass
