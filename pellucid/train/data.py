"""Token shards: text -> token ids on disk (train.bin / val.bin, memmapped) -> random (x, y) batches.

A prepared folder holds train.bin, val.bin (uint16, or uint32 for vocabularies over 65,536 ids),
meta.json and the tokenizer (tokenizer.json), so a model trained on it can be exported and served.

    pellucid data prepare shakespeare --tokenizer char --out data/shakespeare_char
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.progress import track
from tokenizers import Tokenizer as HFTokenizer

from pellucid.train.char_tokenizer import (
    byte_tokenizer,
    char_encode,
    char_tokenizer,
    save_tokenizer,
)
from pellucid.train.corpora import CORPORA, corpus_text

TOKENIZER_KINDS = ("char", "byte")


def read_sources(sources: list[str]) -> str:
    """Named corpora, text files, folders of *.txt / *.jsonl (sorted) and JSONL ({"text": ...})."""
    parts = []
    for source in sources:
        text = corpus_text(source)
        if text is not None:
            parts.append(text)
            continue
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
        elif path.is_file():
            files = [path]
        else:
            raise ValueError(
                f"{source!r} is neither a corpus ({', '.join(CORPORA)}) nor a file or folder"
            )
        parts.extend(read_file(f) for f in files)
    if not parts or not any(parts):
        raise ValueError(f"no text found in {sources}")
    return "".join(parts)


def read_file(path: Path) -> str:
    if path.suffix != ".jsonl":
        return path.read_text(encoding="utf-8")
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            if "text" not in record:
                raise ValueError(f'{path}:{n}: a JSONL record needs a "text" field')
            docs.append(record["text"])
    return "\n".join(docs)


def make_tokenizer(kind: str, text: str) -> HFTokenizer:
    """'char' (the characters of `text`), 'byte', or a folder / tokenizer.json of a trained one."""
    if kind == "char":
        return char_tokenizer(text)
    if kind == "byte":
        return byte_tokenizer()
    path = Path(kind).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--tokenizer {kind!r}: use char, byte or a path to a tokenizer.json")
    return HFTokenizer.from_file(str(path))


def encode(hf: HFTokenizer, kind: str, text: str, chunk_chars: int = 1 << 20) -> np.ndarray:
    if kind == "char":
        return char_encode(hf, text)
    if kind == "byte":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    # Trained BPE: encode in line-aligned chunks so memory stays bounded and batches parallelize.
    lines = text.splitlines(keepends=True)
    chunks, current, size = [], [], 0
    for line in lines:
        current.append(line)
        size += len(line)
        if size >= chunk_chars:
            chunks.append("".join(current))
            current, size = [], 0
    chunks.append("".join(current))
    groups = [chunks[i : i + 16] for i in range(0, len(chunks), 16)]  # 16 MiB per batch call
    ids = []
    for group in track(groups, "encoding", disable=not sys.stderr.isatty(), transient=True):
        ids.extend(
            np.asarray(e.ids, dtype=np.int64)
            for e in hf.encode_batch(group, add_special_tokens=False)
        )
    return np.concatenate(ids)


def prepare(sources: list[str], tokenizer: str, out: Path, val_fraction: float = 0.1) -> dict:
    """Write train.bin, val.bin, meta.json and the tokenizer to `out`; return the metadata."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    text = read_sources(sources)
    hf = make_tokenizer(tokenizer, text)
    ids = encode(hf, tokenizer, text)
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    n_train = int(
        len(ids) * (1 - val_fraction)
    )  # nanoGPT: the first 90% trains, the rest validates
    out.mkdir(parents=True, exist_ok=True)
    write_bin(out / "train.bin", ids[:n_train], dtype)
    write_bin(out / "val.bin", ids[n_train:], dtype)
    if tokenizer in TOKENIZER_KINDS:
        save_tokenizer(hf, out)
    else:  # a trained tokenizer: ship its files as they are (they name EOS)
        source = Path(tokenizer).expanduser()
        source = source if source.is_dir() else source.parent
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (source / name).is_file():
                shutil.copy(source / name, out / name)
    meta = {
        "sources": sources,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "dtype": np.dtype(dtype).name,
        "characters": len(text),
        "train_tokens": n_train,
        "val_tokens": len(ids) - n_train,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def write_bin(path: Path, ids: np.ndarray, dtype: type) -> None:
    arr = np.memmap(path, dtype=dtype, mode="w+", shape=(len(ids),))
    arr[:] = ids
    arr.flush()


@dataclass(slots=True)
class TokenData:
    """A prepared folder, memmapped: batches are read from disk, never loaded whole."""

    folder: Path
    meta: dict
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def open(cls, folder: str | Path) -> TokenData:
        folder = Path(folder).expanduser()
        if not (folder / "meta.json").is_file():
            raise ValueError(
                f"{folder}: not a prepared data folder (no meta.json); "
                "run `pellucid data prepare SOURCE --out FOLDER` first"
            )
        meta = json.loads((folder / "meta.json").read_text())
        split = {
            s: np.memmap(folder / f"{s}.bin", dtype=meta["dtype"], mode="r")
            for s in ("train", "val")
        }
        return cls(folder, meta, split["train"], split["val"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def batch(
        self, split: str, batch_size: int, block_size: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows, as nanoGPT samples them: x (B, T) and y = x shifted by one (B, T)."""
        data = self.train if split == "train" else self.val
        if len(data) <= block_size:
            raise ValueError(f"the {split} split has {len(data)} tokens, fewer than block_size + 1")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=gen).tolist()
        rows = np.stack([data[i : i + block_size + 1] for i in starts]).astype(np.int64)
        xy = torch.from_numpy(rows)  # (B, T + 1)
        return xy[:, :-1], xy[:, 1:]

    def windows(self, split: str, block_size: int) -> torch.Tensor:
        """The whole split as non-overlapping windows (N, T + 1), to score every token once."""
        data = self.train if split == "train" else self.val
        n = (len(data) - 1) // block_size
        idx = np.arange(n)[:, None] * block_size + np.arange(block_size + 1)[None, :]
        return torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
