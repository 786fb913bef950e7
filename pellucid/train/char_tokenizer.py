"""Tokenizers for tiny models, as HF `tokenizers` objects saved to a tokenizer.json the engine loads.

Character level: one id per character seen in the corpus (nanoGPT's shakespeare_char). Byte level:
one id per byte, spelled in GPT-2's printable byte alphabet, so any text encodes. Both are BPE models
without merges, which is what `Tokenizer.from_hf_folder` and transformers read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers


def char_tokenizer(chars: str) -> HFTokenizer:
    """Ids in sorted character order, as nanoGPT's prepare.py assigns them."""
    vocab = {c: i for i, c in enumerate(sorted(set(chars)))}
    return HFTokenizer(models.BPE(vocab=vocab, merges=[]))


def gpt2_byte_alphabet() -> list[str]:
    """The printable character GPT-2 spells each byte 0..255 with (invisible bytes move past 255)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), 256),
    }
    spelled, shifted = [], 0
    for b in range(256):
        if b in printable:
            spelled.append(chr(b))
        else:
            spelled.append(chr(256 + shifted))
            shifted += 1
    return spelled


def byte_tokenizer() -> HFTokenizer:
    """Id b stands for byte b (GPT-2 spells byte b as a printable character)."""
    vocab = {c: b for b, c in enumerate(gpt2_byte_alphabet())}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def char_encode(hf: HFTokenizer, text: str) -> np.ndarray:
    """Fast path for a character tokenizer: a lookup per code point instead of a BPE pass."""
    vocab = hf.get_vocab()
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.full(max(ord(c) for c in vocab) + 1, -1, dtype=np.int64)
    for c, i in vocab.items():
        table[ord(c)] = i
    if codes.max() >= len(table) or (table[codes] < 0).any():
        missing = sorted({c for c in text if c not in vocab})[:10]
        raise ValueError(f"characters {missing} are not in the character vocabulary")
    return table[codes]


def save_tokenizer(hf: HFTokenizer, folder: Path) -> None:
    """tokenizer.json + a tokenizer_config.json without BOS/EOS: these tiny models have neither."""
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": None, "eos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
