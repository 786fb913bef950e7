"""Train a byte-level BPE tokenizer (GPT-2's scheme) with HF `tokenizers`, saved as tokenizer.json.

Any text encodes (every byte is in the base alphabet); merges learned from the corpus make common
words single tokens. `<|endoftext|>` is the EOS token that separates documents.

    pellucid tokenizer train shakespeare-plays --vocab-size 4096 --out tok/shakespeare
    pellucid data prepare shakespeare-plays --tokenizer tok/shakespeare --out data/shakespeare_bpe
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def train_bpe(
    text: str, vocab_size: int, show_progress: bool = True, special: tuple[str, ...] = ()
) -> HFTokenizer:
    """`special`: control tokens besides EOS (a chat format's, say), kept whole and never merged
    into; they take the ids after EOS."""
    if vocab_size < 257 + len(special):
        raise ValueError(
            f"vocab_size must be at least {257 + len(special)} (256 bytes, EOS and "
            f"{len(special)} special tokens), got {vocab_size}"
        )
    hf = HFTokenizer(models.BPE())
    # GPT-2's split (words, numbers, punctuation, spaces) before merging; no merges across words.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    hf.train_from_iterator(line_chunks(text), trainer=trainer, length=None)
    return hf


def line_chunks(text: str, size: int = 1 << 16) -> list[str]:
    """Pieces of about `size` characters cut at line ends, so the trainer can count in parallel."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def save_bpe(hf: HFTokenizer, folder: Path, chat_template: str | None = None) -> None:
    """tokenizer.json + tokenizer_config.json naming EOS (no BOS: documents are just joined) and
    the chat template, where there is one."""
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": None, "eos_token": EOS}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
