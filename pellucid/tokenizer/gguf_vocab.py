"""Read a GGUF's tokenizer metadata the way llama.cpp does and build a `tokenizers` object from it.

'gpt2' vocabularies are byte-level BPE split by llama.cpp's pre-tokenizer regexes; 'llama' ones are
SentencePiece-style BPE whose GGUF keeps no merges, so they are derived from the piece scores;
'gemma4' ones are BPE with merges over '▁'-escaped text, split only at newlines.
Control tokens become special added tokens and user-defined ones (Gemma's runs of spaces, HTML
tags) plain added tokens: both are matched whole, longest first, before the rest is tokenized.
Token types are first corrected as llama.cpp corrects them by the tokens' spelling (spellings.py).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pellucid.errors import ModelLoadError
from pellucid.tokenizer import spellings
from pellucid.tokenizer.parts import (
    TokenizerParts,
    byte_level_piece,
    end_of_turn_ids,
    sentencepiece_piece,
)
from pellucid.tokenizer.pre_tokenizers import LLAMA3_FAMILY, byte_level_pre_tokenizer, regexes_for
from pellucid.tokenizer.token_types import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

log = logging.getLogger(__name__)

# What pellucid's export writes as the merges of a char/byte vocabulary, which has none: llama.cpp
# needs the key, the gguf writer refuses an empty array, and no symbol can ever equal these parts.
NO_MERGES = "<no-merges> <no-merges>"
# Part of every cache key: bump it when the tokenizer built from the same GGUF changes.
CACHE_FORMAT = "pellucid-gguf-tokenizer-1"


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer fields of GGUF metadata, checked, with llama.cpp's defaults filled in."""

    model: str  # 'gpt2': byte-level BPE, 'llama': SentencePiece-style BPE, or 'gemma4'
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    # what else ends generation: the end-of-turn / end-of-message ids the GGUF names, and the
    # tokens llama.cpp stops on by their spelling (tokenizer/spellings.py)
    extra_eos_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> GGUFVocab:
        model = metadata.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama", "gemma4"):
            raise ModelLoadError(_unsupported_model(model))
        tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelLoadError(
                "the GGUF metadata has no tokenizer.ggml.tokens; the file is incomplete"
            )
        n = len(tokens)
        types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * n)
        merges = [m for m in metadata.get("tokenizer.ggml.merges") or [] if m != NO_MERGES]
        scores = list(metadata.get("tokenizer.ggml.scores") or [])
        _check_lengths(model, tokens, types, merges, scores)
        pre = _pre_name(model, metadata)
        ids = {key: _token_id(metadata, key, n) for key in ("bos", "eos", "unknown", "eot", "eom")}
        named_stops = {ids[key] for key in ("eos", "eot", "eom") if ids[key] is not None}
        types, stops = spellings.retype(tokens, types, metadata, named_stops)
        # llama.cpp's defaults where a flag is absent: SentencePiece and Llama 3 add BOS.
        flag = {
            name: bool(metadata.get(f"tokenizer.ggml.{name}", default))
            for name, default in [
                ("add_bos_token", model in ("llama", "gemma4") or pre in LLAMA3_FAMILY),
                ("add_eos_token", False),
                ("add_space_prefix", model == "llama"),
            ]
        }
        if model == "gemma4":  # llama.cpp adds Gemma 4's BOS whatever the file says
            flag["add_bos_token"] = True
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            token_types=types,
            merges=merges,
            scores=scores,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            unk_id=ids["unknown"],
            extra_eos_ids=tuple(sorted(stops)),
            add_bos=flag["add_bos_token"],
            add_eos=flag["add_eos_token"],
            add_space_prefix=flag["add_space_prefix"],
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    def fingerprint(self) -> str:
        """A hash of everything the built tokenizer depends on: the name of its disk-cache entry."""
        h = hashlib.sha256()
        head = [CACHE_FORMAT, tokenizers.__version__, self.model, self.pre]
        head += [self.unk_id, self.add_space_prefix]
        for part in (repr(head), "\0".join(self.tokens), "\n".join(self.merges)):
            h.update(part.encode())
            h.update(b"\xff")  # a byte UTF-8 never contains, so fields cannot run into each other
        h.update(np.asarray(self.token_types, dtype=np.int32).tobytes())
        h.update(np.asarray(self.scores, dtype=np.float32).tobytes())
        return h.hexdigest()[:32]


def build_hf_tokenizer(vocab: GGUFVocab) -> HFTokenizer:
    """The `tokenizers` object that encodes like llama.cpp (seconds for 262k tokens: cache it)."""
    build = {"gpt2": _byte_level_bpe, "gemma4": _escaped_bpe, "llama": _sentencepiece_bpe}
    hf = build[vocab.model](vocab)
    # llama.cpp matches control/unknown tokens only with parse_special, user-defined ones always.
    hf.add_special_tokens(_added_tokens(vocab, (CONTROL, UNKNOWN), special=True))
    hf.add_tokens(_added_tokens(vocab, (USER_DEFINED,), special=False))
    return hf


def tokenizer_parts(vocab: GGUFVocab, hf: HFTokenizer) -> TokenizerParts:
    byte_level = vocab.model == "gpt2"
    pieces = [_piece(t, ty, byte_level) for t, ty in zip(vocab.tokens, vocab.token_types)]
    special_ids = frozenset(i for i, ty in enumerate(vocab.token_types) if ty in (CONTROL, UNKNOWN))
    eos_ids = end_of_turn_ids({vocab.tokens[i]: i for i in special_ids}, vocab.eos_id)
    return TokenizerParts(
        hf=hf,
        pieces=pieces,
        special_ids=special_ids,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        eos_ids=eos_ids | set(vocab.extra_eos_ids),
        add_bos=vocab.add_bos,
        add_eos=vocab.add_eos,
        add_space_prefix=vocab.add_space_prefix and not byte_level,
        chat_template=vocab.chat_template,
    )


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the adjacent pair whose joined piece scores highest. As ranked BPE
    merges that is every cut of a piece into two vocabulary pieces, best-scoring piece first."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()  # (i, cut) is unique, so ties never reach the strings
    return [(left, right) for *_, left, right in ranked]


def _added_tokens(vocab: GGUFVocab, types: tuple[int, ...], *, special: bool) -> list[AddedToken]:
    return [
        AddedToken(token, special=special, normalized=False)  # matched in the raw text
        for token, token_type in zip(vocab.tokens, vocab.token_types)
        if token_type in types and token
    ]


def _byte_level_bpe(vocab: GGUFVocab) -> HFTokenizer:
    merges = [_split_merge(m) for m in vocab.merges]
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    hf = HFTokenizer(models.BPE(ids, merges, ignore_merges=vocab.pre in LLAMA3_FAMILY))
    hf.pre_tokenizer = byte_level_pre_tokenizer(vocab.pre)
    hf.decoder = decoders.ByteLevel()
    return hf


def _escaped_bpe(vocab: GGUFVocab) -> HFTokenizer:
    """Gemma 4's BPE: spaces written as '▁', merges over UTF-8 characters (not bytes) within each
    line and each run of newlines, '<0xXX>' tokens for what no piece covers."""
    merges = [_split_merge(m) for m in vocab.merges]
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    hf = HFTokenizer(models.BPE(ids, merges, byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return hf


def _sentencepiece_bpe(vocab: GGUFVocab) -> HFTokenizer:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    merges = merges_from_scores(vocab.tokens, vocab.scores)
    hf = HFTokenizer(models.BPE(ids, merges, unk_token=unk, byte_fallback=True))
    # No pre-tokenizer: SentencePiece tokenizes each stretch between added tokens as one word.
    escape = normalizers.Replace(" ", "▁")
    hf.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), escape])
        if vocab.add_space_prefix
        else escape
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    return hf


def _piece(token: str, token_type: int, byte_level: bool) -> bytes:
    """The bytes llama.cpp's token_to_piece gives for a token (special tokens rendered as text)."""
    if token_type in (CONTROL, UNKNOWN, USER_DEFINED):
        return token.encode()
    if token_type == NORMAL:
        return (
            byte_level_piece(token)
            if byte_level
            else sentencepiece_piece(token, byte_fallback=False)
        )
    if token_type == BYTE and not byte_level:
        return sentencepiece_piece(token, byte_fallback=True)
    return b""  # unused tokens (and byte tokens in a byte-level vocabulary) render as nothing


def _split_merge(merge: str) -> tuple[str, str]:
    cut = merge.find(" ", 1)  # from 1, as llama.cpp: a merge's left side may itself be a space
    if cut < 0:
        raise ModelLoadError(
            f"GGUF merge {merge!r} is not two tokens separated by a space; the file is corrupt"
        )
    return merge[:cut], merge[cut + 1 :]


def _pre_name(model: str, metadata: dict[str, Any]) -> str:
    pre = metadata.get("tokenizer.ggml.pre")
    if model == "gemma4":
        return "gemma4"  # its split is fixed: lines and runs of newlines
    if model != "gpt2":
        return pre or "default"  # llama.cpp ignores the pre-tokenizer of SentencePiece vocabularies
    if not pre:
        log.warning(
            "GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' split (quality may suffer)"
        )
        pre = "default"
    regexes_for(pre)  # fail at load time, not at the first prompt
    return pre


def _token_id(metadata: dict[str, Any], name: str, n: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    if not 0 <= int(value) < n:
        raise ModelLoadError(
            f"GGUF {name} token id {value} is outside the vocabulary of {n} tokens"
        )
    return int(value)


def _check_lengths(model: str, tokens: list, types: list, merges: list, scores: list) -> None:
    n = len(tokens)
    if len(types) != n:
        raise ModelLoadError(
            f"GGUF has {n} tokens but {len(types)} token types; the file is corrupt"
        )
    # A character- or byte-level vocabulary (every ordinary token one symbol) needs no merges;
    # a token of several symbols could never be produced without them.
    merged = any(len(t) > 1 for t, kind in zip(tokens, types, strict=True) if kind == NORMAL)
    if model in ("gpt2", "gemma4") and not merges and merged:
        raise ModelLoadError(
            "GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges; the file is incomplete"
        )
    if model == "llama" and len(scores) != n:
        raise ModelLoadError(
            f"GGUF SentencePiece vocabulary has {len(scores)} scores for {n} tokens; "
            "pellucid needs one score per token to derive the merges"
        )


def _unsupported_model(model: object) -> str:
    if model is None:
        return "the GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)"
    return (
        f"GGUF tokenizer model {model!r} is not supported by pellucid; it reads 'gpt2' "
        "(byte-level BPE), 'llama' (SentencePiece-style BPE) and 'gemma4' vocabularies"
    )
