"""What a Tokenizer is made of, whichever file it came from, and the bytes each token stands for.

Every token id stands for a fixed byte string, its piece: decoding is joining pieces and reading the
bytes as UTF-8. Byte-level BPE (GPT-2) spells bytes as printable characters ('Ġ' is a space);
SentencePiece spells a space as '▁' and falls back to byte tokens '<0xE2>'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer

# End-of-turn tokens a chat model stops on besides EOS (llama.cpp's end-of-generation list).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(slots=True)
class TokenizerParts:
    hf: HFTokenizer  # encodes; its added tokens are the control and user-defined tokens
    pieces: list[bytes]  # pieces[id]: the bytes token `id` stands for
    special_ids: frozenset[
        int
    ]  # control tokens: text only with parse_special, dropped by skip_special
    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: (
        bool  # SentencePiece's leading '▁', removed again from the first piece on decode
    )
    chat_template: str | None


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), 256),
    ]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # bytes that would be invisible or whitespace get the next free code points from 256
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_chars()
# For str.translate: each character of the alphabet becomes the character of its byte's code, so
# the result encodes as Latin-1 byte for byte; characters below 256 outside the alphabet become
# one that Latin-1 cannot encode, as characters from 256 up already are (a vocabulary's worth of
# tokens is read at every load: one C call per token, not a Python loop per character).
_TO_BYTE_CODE = {ord(c): chr(b) for c, b in _BYTE_OF_CHAR.items()} | {
    i: "\uffff" for i in range(256) if chr(i) not in _BYTE_OF_CHAR
}


def byte_level_piece(token: str) -> bytes:
    """'Ġthe' -> b' the'. A character outside GPT-2's byte alphabet stands for itself, as in HF."""
    try:
        return token.translate(_TO_BYTE_CODE).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode()


def sentencepiece_piece(token: str, *, byte_fallback: bool, replacement: str = "▁") -> bytes:
    """'▁the' -> b' the'; with `byte_fallback` a byte token '<0xE2>' -> b'\\xe2'."""
    byte = _BYTE_TOKEN.fullmatch(token) if byte_fallback else None
    if byte:
        return bytes([int(byte.group(1), 16)])
    return token.replace(replacement, " ").encode()


def end_of_turn_ids(token_to_id: dict[str, int], eos_id: int | None) -> frozenset[int]:
    """EOS plus the vocabulary's end-of-turn tokens (`token_to_id` holds special tokens only)."""
    ids = {token_to_id[t] for t in END_OF_TURN_TOKENS if t in token_to_id}
    return frozenset(ids | ({eos_id} if eos_id is not None else set()))
