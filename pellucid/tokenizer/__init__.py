"""Tokenization: `Tokenizer` (text <-> ids as llama.cpp does it, chat templates) and
`IncrementalDetokenizer` (UTF-8-safe text deltas while generating)."""

from pellucid.tokenizer.detokenizer import IncrementalDetokenizer
from pellucid.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
