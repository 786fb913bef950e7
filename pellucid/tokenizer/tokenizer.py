"""Tokenizer: text to token ids and back, as llama.cpp does it, on Hugging Face `tokenizers`.

tok = Tokenizer.from_gguf(path)  # a model's GGUF, or a vocabulary-only one; or .from_hf_folder
ids = tok.encode("Hello", add_special=True)  # BOS first if the model wants one
tok.decode(ids), tok.id_to_piece(ids[-1]), tok.apply_chat_template(messages)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pellucid.errors import PromptError
from pellucid.tokenizer.chat_template import ChatTemplate
from pellucid.tokenizer.gguf_vocab import GGUFVocab, build_hf_tokenizer, tokenizer_parts
from pellucid.tokenizer.hf_folder import read_hf_folder
from pellucid.tokenizer.parts import TokenizerParts
from pellucid.tokenizer.tokenizer_cache import load_or_build
from pellucid.weights.gguf_file import read_metadata


class Tokenizer:
    """Encodes with a `tokenizers` object; decodes by joining the bytes each id stands for."""

    def __init__(self, parts: TokenizerParts):
        self.hf: HFTokenizer = parts.hf  # the underlying tokenizers object, for inspection
        self._pieces = parts.pieces
        self._special_ids = parts.special_ids
        self.vocab_size = len(parts.pieces)
        self.bos_id = parts.bos_id
        self.eos_id = parts.eos_id
        self.eos_ids: set[int] = set(parts.eos_ids)
        self.add_bos = parts.add_bos
        self.add_eos = parts.add_eos
        self.add_space_prefix = parts.add_space_prefix
        self.chat_template = parts.chat_template
        self._template: ChatTemplate | None = None
        # `encode_special_tokens` is a setting of the shared HF object: set+encode must not interleave.
        self._encode_lock = threading.Lock()

    @classmethod
    def from_gguf_metadata(
        cls, metadata: dict[str, Any], cache_dir: Path | None = None
    ) -> Tokenizer:
        """Build from GGUF metadata; the result is cached on disk (`cache_dir` overrides the root)."""
        vocab = GGUFVocab.from_metadata(metadata)
        hf = load_or_build(vocab.fingerprint(), lambda: build_hf_tokenizer(vocab), cache_dir)
        return cls(tokenizer_parts(vocab, hf))

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
        """The tokenizer of a GGUF file: a model's, or a vocabulary-only file such as llama.cpp's
        tokenizer tests use (only its metadata is read)."""
        return cls.from_gguf_metadata(read_metadata(path), cache_dir)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        """Read tokenizer.json and tokenizer_config.json of a Hugging Face model folder."""
        return cls(read_hf_folder(Path(folder)))

    def encode(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """Token ids of `text`. `add_special` adds BOS/EOS as the model asks; control tokens written
        in the text ('<|im_end|>') become their ids only with `parse_special`, else stay plain text."""
        with self._encode_lock:
            self.hf.encode_special_tokens = not parse_special
            ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 come out as U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """The bytes `ids` stand for, joined (what `decode` reads as UTF-8)."""
        ids = self._checked(ids)
        data = b"".join(
            self._pieces[i] for i in ids if not (skip_special and i in self._special_ids)
        )
        if ids and self._strips_first_space(ids[0], skip_special):
            data = data[1:]
        return data

    def id_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a byte token: one byte, maybe half a character)."""
        return self._pieces[self._checked([token_id])[0]]

    def id_to_piece(self, token_id: int) -> str:
        """A readable piece for display: 'Ġthe' -> ' the', a lone byte of a character -> '\\xe2'."""
        return self.id_to_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def is_special(self, token_id: int) -> bool:
        """Control tokens (BOS, EOS, '<|im_start|>', ...): dropped by decode(skip_special=True)."""
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered as HF's apply_chat_template renders it."""
        if self.chat_template is None:
            raise PromptError(
                "this model has no chat template: it is a base model, not a chat model; "
                "give it plain text to complete instead of messages"
            )
        if self._template is None:
            self._template = ChatTemplate(
                self.chat_template,
                bos_token=self._token_text(self.bos_id),
                eos_token=self._token_text(self.eos_id),
            )
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )

    def config(self) -> dict[str, Any]:
        """tokenizer_config.json's keys: the special tokens' text, whether BOS/EOS are added,
        the chat template (where the model has one)."""
        return {
            "bos_token": self._token_text(self.bos_id),
            "eos_token": self._token_text(self.eos_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            **({"chat_template": self.chat_template} if self.chat_template is not None else {}),
        }

    def save_hf_folder(self, folder: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (read by `from_hf_folder`, transformers),
        and the ids that end generation as generation_config.json's eos_token_id (its other
        keys, where the file exists, are kept)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(
            json.dumps(self.config(), indent=2, ensure_ascii=False)
        )
        generation = folder / "generation_config.json"
        kept = json.loads(generation.read_text()) if generation.is_file() else {}
        kept["eos_token_id"] = sorted(self.eos_ids)
        generation.write_text(json.dumps(kept, indent=2) + "\n")

    def _strips_first_space(self, first: int, skip_special: bool) -> bool:
        """SentencePiece put a space before the text when encoding; llama.cpp drops it again from the
        first token's piece (that token only, and not when skip_special dropped the token itself)."""
        skipped = skip_special and first in self._special_ids
        return self.add_space_prefix and not skipped and self._pieces[first].startswith(b" ")

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.hf.id_to_token(token_id)

    def _checked(self, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids
