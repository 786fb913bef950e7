"""Supervised fine-tuning of a chat model (SmolLM2 by default) on chat JSONL, full or with LoRA.

Each line is {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]},
rendered with the model's own chat template. Only the assistant's tokens (including the end-of-turn
token, so the model learns where to stop) count in the loss. LoRA updates are merged on export:

    pellucid sft --model smollm2-135m --data chat.jsonl --out models/smol-sft --lora-rank 8
    pellucid generate "What is your name?" --chat --model models/smol-sft
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from pellucid import catalog
from pellucid.cpu import matmul_float
from pellucid.loading.loader import read_checkpoint
from pellucid.models import build_model
from pellucid.models.llama import LlamaModel
from pellucid.tokenizer import Tokenizer
from pellucid.train.hf_export import export_hf
from pellucid.train.lora import add_lora, merge_lora
from pellucid.train.schedule import lr_at

IGNORE = -100  # label of tokens that do not count in the loss (prompt, padding)


@dataclass(slots=True)
class SFTConfig:
    model: str  # catalog name, GGUF file or HF folder
    data: str  # chat JSONL
    out: str  # the exported HF folder
    lora_rank: int = 8  # 0: full fine-tuning of every weight
    lora_alpha: float = 16.0
    epochs: int = 3
    batch_size: int = 4  # conversations per step
    lr: float | None = None  # None: 1e-3 for LoRA, 3e-5 for full fine-tuning
    max_len: int = 512
    dtype: str = matmul_float()  # bf16 autocast where the CPU has it natively
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lora_rank < 0 or self.epochs <= 0 or self.batch_size <= 0 or self.max_len <= 1:
            raise ValueError("lora_rank >= 0, epochs > 0, batch_size > 0 and max_len > 1 please")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.lora_rank else 3e-5)


def read_chats(path: Path) -> list[list[dict]]:
    chats = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        messages = record.get("messages") if isinstance(record, dict) else None
        if not messages or not any(m.get("role") == "assistant" for m in messages):
            raise ValueError(f'{path}:{n}: each line needs "messages" with an assistant turn')
        chats.append(messages)
    if not chats:
        raise ValueError(f"{path}: no conversations")
    return chats


def encode_chat(tok: Tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels: the id on assistant tokens, else IGNORE."""

    def ids_of(msgs: list[dict], prompt: bool) -> list[int]:
        text = tok.apply_chat_template(msgs, add_generation_prompt=prompt)
        return tok.encode(text, add_special=True, parse_special=True)

    ids = ids_of(messages, prompt=False)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(ids_of(messages[:i], prompt=True))  # up to "<|im_start|>assistant\n"
        through = ids_of(messages[: i + 1], prompt=False)  # ... and the reply with its end token
        if ids[: len(through)] != through:
            raise ValueError(
                "the chat template does not render turns as prefixes of the whole "
                "conversation; assistant tokens cannot be located"
            )
        labels[start : len(through)] = ids[start : len(through)]
    return ids[:max_len], labels[:max_len]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad to the longest: causal attention never lets real tokens see the padding."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)], labels[row, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels


def load_trainable(model: str) -> tuple[LlamaModel, Tokenizer]:
    """The model in float32 with gradients on (the inference loader freezes it)."""
    ckpt = read_checkpoint(catalog.resolve(model))
    if ckpt.gguf_metadata is not None:
        tok = Tokenizer.from_gguf_metadata(ckpt.gguf_metadata)
    else:
        tok = Tokenizer.from_hf_folder(ckpt.path)
    net = build_model(ckpt.config)
    missing = set(net.state_dict()) - set(ckpt.state) - {"lm_head.weight"}
    if missing:
        raise ValueError(f"{ckpt.path}: checkpoint lacks {sorted(missing)[:3]}")
    net.load_state_dict(ckpt.state, strict=False)
    return net.train(), tok


def sft_loss(model: LlamaModel, ids: Tensor, labels: Tensor, autocast: bool) -> Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids)  # (B, T, V)
    # position t predicts token t + 1; only assistant tokens have labels
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE
    )


def fine_tune(
    cfg: SFTConfig,
    log: Callable[[str], None] = print,
    history: list[tuple[int, float]] | None = None,
) -> Path:
    """Train, merge LoRA, export to cfg.out; returns the folder. `history` gets (step, loss)
    of every step."""
    torch.manual_seed(cfg.seed)
    model, tok = load_trainable(cfg.model)
    examples = [encode_chat(tok, chat, cfg.max_len) for chat in read_chats(Path(cfg.data))]
    if cfg.lora_rank:
        trainable = add_lora(model, cfg.lora_rank, cfg.lora_alpha)
    else:
        trainable = sum(p.numel() for p in model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total = cfg.epochs * steps_per_epoch
    log(f"{len(examples)} conversations, {trainable:,} trainable parameters, {total} steps")
    gen = torch.Generator().manual_seed(cfg.seed)
    pad = tok.eos_id if tok.eos_id is not None else 0
    step = 0
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(examples), generator=gen).tolist()
        for b in range(steps_per_epoch):
            batch = [examples[i] for i in order[b * cfg.batch_size : (b + 1) * cfg.batch_size]]
            ids, labels = collate(batch, pad)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(
                    step, cfg.learning_rate, cfg.learning_rate / 10, max(1, total // 10), total
                )
            loss = sft_loss(model, ids, labels, cfg.dtype == "bfloat16")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            log(f"epoch {epoch + 1} step {step}/{total}: loss {loss.item():.4f}")
            if history is not None:
                history.append((step, loss.item()))
    if cfg.lora_rank:
        merge_lora(model)
    with tempfile.TemporaryDirectory() as tok_dir:
        tok.save_hf_folder(Path(tok_dir))
        return export_hf(model.eval(), Path(tok_dir), Path(cfg.out))
