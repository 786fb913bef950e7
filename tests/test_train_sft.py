"""Fine-tuning: assistant-only loss masks, LoRA that starts as the base model and merges exactly,
and SFT (LoRA and full) that changes what an exported model answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_text

from pellucid import LLM, SamplingParams
from pellucid.train.data import prepare
from pellucid.train.hf_export import export_hf
from pellucid.train.lora import LoRALinear, add_lora, merge_lora
from pellucid.train.sft import IGNORE, SFTConfig, encode_chat, fine_tune
from pellucid.train.trainer import Trainer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
REPLY = "a fool of france"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny character-level model with a chat template, exported as an HF folder."""
    root = tmp_path_factory.mktemp("chat")
    (root / "t.txt").write_text(tiny_text() + "user: who are you\nassistant: the king\n" * 30)
    prepare([str(root / "t.txt")], "char", root / "data")
    trainer = Trainer(
        tiny_config(root / "data", root / "run", max_iters=200, block_size=64, batch_size=8),
        verbose=False,
    )
    trainer.run()
    folder = export_hf(trainer.model, root / "data", root / "model")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    chats = [
        {
            "messages": [
                {"role": "user", "content": "who are you"},
                {"role": "assistant", "content": REPLY},
            ]
        }
    ] * 4
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return folder


def reply(folder: Path) -> str:
    llm = LLM(folder, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=len(REPLY))
    return llm.chat([{"role": "user", "content": "who are you"}], params).text


def test_only_assistant_tokens_carry_labels(chat_model: Path):
    tok = LLM(chat_model, dtype="float32").tokenizer
    messages = [
        {"role": "user", "content": "who are you"},
        {"role": "assistant", "content": "a king"},
        {"role": "user", "content": "and you"},
        {"role": "assistant", "content": "a fool"},
    ]
    ids, labels = encode_chat(tok, messages, max_len=1000)
    kept = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    assert tok.decode(kept) == "a king\na fool\n"  # both replies with their line ends, nothing else
    assert all(lab in (IGNORE, t) for t, lab in zip(ids, labels, strict=True))


def test_lora_starts_as_the_base_and_merges_exactly():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    before = base(x)
    model = torch.nn.Sequential(*base)  # same modules
    trainable = add_lora(model, rank=2, alpha=4.0, targets=("0", "2"))
    assert trainable == 2 * (8 + 16) + 2 * (16 + 4)
    assert torch.equal(model(x), before)  # B = 0: no change until trained
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.normal_()
    adapted = model(x)
    merged = merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    torch.testing.assert_close(merged(x), adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [4, 0])  # LoRA, then full fine-tuning
def test_sft_changes_the_answer_of_the_exported_model(chat_model: Path, tmp_path: Path, rank: int):
    torch.set_num_threads(1)
    assert not reply(chat_model).startswith(REPLY)
    cfg = SFTConfig(
        model=str(chat_model),
        data=str(chat_model.parent / "chats.jsonl"),
        out=str(tmp_path / "sft"),
        lora_rank=rank,
        epochs=40,
        batch_size=4,
        lr=1e-2 if rank else 3e-3,
        dtype="float32",
    )
    folder = fine_tune(cfg, log=lambda line: None)
    assert reply(folder) == REPLY


def test_smollm2_chat_masks_the_reply_and_its_end_of_turn(smollm2_path: Path):
    from pellucid.tokenizer import Tokenizer
    from pellucid.weights.gguf_file import read_metadata

    tok = Tokenizer.from_gguf_metadata(read_metadata(smollm2_path))
    messages = [
        {"role": "user", "content": "What is your name?"},
        {"role": "assistant", "content": "I am Pellucid."},
    ]
    ids, labels = encode_chat(tok, messages, max_len=1000)
    kept = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    assert tok.decode(kept) == "I am Pellucid.<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>system")
