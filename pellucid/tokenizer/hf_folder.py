"""Read the tokenizer of a Hugging Face model folder: tokenizer.json plus tokenizer_config.json.

tokenizer.json encodes as is. The bytes each id stands for follow its decoder: byte-level (GPT-2) or
SentencePiece's '▁' with byte fallback. BOS/EOS, add_bos and the chat template come from
tokenizer_config.json (or chat_template.jinja), extra stop ids from generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pellucid.errors import ModelLoadError
from pellucid.tokenizer.parts import (
    TokenizerParts,
    byte_level_piece,
    end_of_turn_ids,
    sentencepiece_piece,
)

UNSUPPORTED_DECODERS = {"WordPiece", "BPEDecoder", "CTC"}


def read_hf_folder(folder: Path) -> TokenizerParts:
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"{folder}: no tokenizer.json; pellucid reads the fast-tokenizer file that "
            "transformers' `tokenizer.save_pretrained(folder)` writes"
        )
    spec = _read_json(folder / "tokenizer.json")
    config = _read_json(folder / "tokenizer_config.json")
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    special = {t["content"]: i for i, t in added.items() if t.get("special")}
    bos_id = _config_token_id(hf, config.get("bos_token"))
    eos_id = _config_token_id(hf, config.get("eos_token"))
    strip_first_space, pieces = _pieces(hf, spec, set(added))
    return TokenizerParts(
        hf=hf,
        pieces=pieces,
        special_ids=frozenset(special.values()),
        bos_id=bos_id,
        eos_id=eos_id,
        eos_ids=end_of_turn_ids(special, eos_id) | _generation_eos_ids(folder),
        add_bos=_adds_token(hf, config.get("add_bos_token"), bos_id, first=True),
        add_eos=_adds_token(hf, config.get("add_eos_token"), eos_id, first=False),
        add_space_prefix=strip_first_space,
        chat_template=_chat_template(folder, config),
    )


def _pieces(hf: HFTokenizer, spec: dict[str, Any], added: set[int]) -> tuple[bool, list[bytes]]:
    """(whether decoding drops the first piece's leading space, the bytes of every id)."""
    steps = _flatten(spec.get("decoder"))
    kinds = {d["type"] for d in steps}
    if kinds & UNSUPPORTED_DECODERS:
        raise ModelLoadError(
            f"this tokenizer.json decodes with {sorted(kinds & UNSUPPORTED_DECODERS)}; pellucid "
            "decodes byte-level and SentencePiece-style tokenizers (those of causal LMs)"
        )
    byte_level = "ByteLevel" in kinds
    byte_fallback = "ByteFallback" in kinds or bool(spec.get("model", {}).get("byte_fallback"))
    replacement = next((d.get("replacement", "▁") for d in steps if d["type"] == "Metaspace"), "▁")
    vocab = hf.get_vocab(with_added_tokens=True)
    pieces = [b""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        if i in added:
            pieces[i] = token.encode()
        elif byte_level:
            pieces[i] = byte_level_piece(token)
        else:
            pieces[i] = sentencepiece_piece(
                token, byte_fallback=byte_fallback, replacement=replacement
            )
    return any(_strips_first_space(d) for d in steps), pieces


def _strips_first_space(step: dict[str, Any]) -> bool:
    if step["type"] == "Strip":
        return step.get("content") == " " and step.get("start", 0) > 0
    if step["type"] == "Metaspace":  # its prepended '▁' is dropped from the first token again
        prepends = step.get("prepend_scheme", "always") != "never"
        return prepends and step.get("add_prefix_space", True)
    return False


def _flatten(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not decoder:
        return []
    if decoder["type"] == "Sequence":
        return [d for sub in decoder["decoders"] for d in _flatten(sub)]
    return [decoder]


def _config_token_id(hf: HFTokenizer, token: str | dict[str, Any] | None) -> int | None:
    if isinstance(token, dict):  # older configs store AddedToken objects
        token = token.get("content")
    return hf.token_to_id(token) if token else None


def _adds_token(hf: HFTokenizer, flag: bool | None, token_id: int | None, *, first: bool) -> bool:
    """The config's add_bos_token/add_eos_token, else what tokenizer.json's post-processor does."""
    if token_id is None:
        return False
    if flag is not None:
        return bool(flag)
    ids = hf.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0 if first else -1] == token_id


def _generation_eos_ids(folder: Path) -> frozenset[int]:
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(
            f"{path}: not valid JSON ({e}); restore the file from the model's source"
        ) from e
