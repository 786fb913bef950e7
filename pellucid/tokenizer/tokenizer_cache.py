"""A disk cache of built `tokenizers` objects, so a 262k-token vocabulary is not rebuilt each load.

An entry is <root>/<key>/tokenizer.json, where root is the `cache_root` argument, else
$XDG_CACHE_HOME/pellucid/tokenizers, else ~/.cache/pellucid/tokenizers. A file is written under a
temporary name and renamed into place, so a killed process never leaves half of one behind; an entry
that fails to load anyway is rebuilt and replaced.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pellucid.atomic import atomic_path

log = logging.getLogger(__name__)


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pellucid" / "tokenizers"


def cache_path(key: str, cache_root: Path | None = None) -> Path:
    return Path(cache_root or default_cache_root()) / key / "tokenizer.json"


def load_or_build(
    key: str, build: Callable[[], HFTokenizer], cache_root: Path | None = None
) -> HFTokenizer:
    """The tokenizer cached under `key`, else `build()`'s result, written to the cache for later."""
    path = cache_path(key, cache_root)
    hf = _load(path)
    if hf is None:
        hf = build()
        _save(hf, path)
    return hf


def _load(path: Path) -> HFTokenizer | None:
    if not path.is_file():
        return None
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for unreadable JSON
        log.warning("tokenizer cache %s is unreadable (%s); rebuilding it", path, e)
        return None


def _save(hf: HFTokenizer, path: Path) -> None:
    try:
        with atomic_path(path) as tmp:  # readers see the old file or the whole new one
            hf.save(str(tmp), pretty=False)
    except Exception as e:  # noqa: BLE001 - a read-only or full disk costs a later rebuild, no more
        log.warning(
            "could not write tokenizer cache %s (%s); it will be rebuilt next time", path, e
        )
