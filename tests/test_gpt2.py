"""GPT-2 (nanoGPT's block): logits equal to transformers' GPT2LMHeadModel, trained here and served
by the engine (KV cache, learned positions), exported to HF folders and GGUF files that pellucid,
transformers and llama.cpp read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import prepare_tiny_corpus, tiny_config, tiny_text

from pellucid.loading.loader import build_from_state, read_checkpoint
from pellucid.models import build_model
from pellucid.models.config import ModelConfig
from pellucid.train.data import prepare
from pellucid.train.export import export_checkpoint
from pellucid.train.hf_export import export_hf
from pellucid.train.init import init_weights
from pellucid.train.trainer import Trainer


def random_gpt2(bias: bool, act: str, seed: int = 0) -> torch.nn.Module:
    cfg = ModelConfig(
        arch="gpt2",
        vocab_size=67,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        ffn_dim=256,
        norm_eps=1e-5,
        rope_theta=0.0,
        context_length=32,
        attn_bias=bias,
        hidden_act=act,
    )
    model = build_model(cfg)
    init_weights(model, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-zero biases and norm gains, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Trainer, Path]:
    tmp = tmp_path_factory.mktemp("gpt2")
    (tmp / "t.txt").write_text(tiny_text(3000))
    prepare([str(tmp / "t.txt")], "char", tmp / "data")
    trainer = Trainer(
        tiny_config(tmp / "data", tmp / "run", arch="gpt2", max_iters=40, block_size=32),
        verbose=False,
    )
    trainer.run()
    return trainer, tmp


@pytest.mark.parametrize(("bias", "act"), [(False, "gelu"), (True, "gelu_new")])
def test_hf_export_matches_transformers_gpt2(tmp_path: Path, bias: bool, act: str):
    from transformers import GPT2LMHeadModel

    model = random_gpt2(bias, act)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    folder = export_hf(model, tmp_path / "tok", tmp_path / "hf")
    ids = torch.randint(0, 67, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(ids)
        theirs = GPT2LMHeadModel.from_pretrained(folder).eval()(ids).logits
        ckpt = read_checkpoint(folder)
        reloaded = build_from_state(ckpt.config, ckpt.state, torch.float32, str(folder))(ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert ckpt.config.hidden_act == act
    torch.testing.assert_close(reloaded, ours, rtol=0, atol=0)


def test_trains_and_the_engine_serves_it(trained: tuple[Trainer, Path]):
    from pellucid import LLM, SamplingParams

    trainer, tmp = trained
    losses = trainer.history["train"]
    assert losses[-1][1] < losses[0][1] - 0.5  # it learned something
    assert {"embed_positions.weight"} <= set(trainer.model.state_dict())
    llm = LLM(export_checkpoint(tmp / "run", tmp / "hf"), dtype="float32")
    ids = llm.encode("The king and the")
    with torch.no_grad():
        ours = trainer.model.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(llm.logits(ids), ours, rtol=1e-5, atol=1e-5)
    # the engine's cached decode (positions looked up per token) equals recomputing every step
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    seq = list(ids)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(trainer.model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(ids) :]


def test_prompt_over_learned_positions_is_refused(trained: tuple[Trainer, Path]):
    from pellucid import LLM, SamplingParams

    _, tmp = trained
    llm = LLM(export_checkpoint(tmp / "run", tmp / "hf2"), dtype="float32")
    with pytest.raises(ValueError, match="context"):
        llm.generate("the king " * 5, SamplingParams(max_tokens=1))  # 45 tokens, 32 positions


@pytest.mark.parametrize("tokenizer", ["bpe", "char"])
def test_gguf_export_round_trips_and_llama_cpp_agrees(tmp_path: Path, tokenizer: str):
    from pellucid import LLM

    prepare_tiny_corpus(tmp_path, tokenizer)
    trainer = Trainer(
        tiny_config(
            tmp_path / "data", tmp_path / "run", arch="gpt2", max_iters=30, bias=True, block_size=32
        ),
        verbose=False,
    )
    trainer.run()
    path = export_checkpoint(tmp_path / "run", tmp_path / "new" / "model.gguf")  # makes "new"
    llm = LLM(path, dtype="float32")
    ids = llm.encode("The king and the queen")
    with torch.no_grad():
        ours = trainer.model.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(llm.logits(ids), ours, rtol=1e-5, atol=1e-5)

    llama_cpp = pytest.importorskip("llama_cpp")  # installed by `make bench`
    ref = llama_cpp.Llama(str(path), n_ctx=32, logits_all=True, verbose=False, n_threads=1)
    assert ref.tokenize(b"The king and the queen", add_bos=False) == ids
    ref.eval(ids)
    theirs = torch.tensor(ref.scores[: len(ids)])
    # measured 4e-5: llama.cpp's own kernels (and its GELU) in float32
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-3)
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()
