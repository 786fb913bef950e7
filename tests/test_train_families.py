"""Llama and its relatives trained from scratch: Qwen2 (Q/K/V biases), Qwen3 (Q/K norms) and
Mistral (a sliding window). Each exports as its own family: transformers' class for that family reads the HF
folder and computes the trained model's logits; pellucid serves the folder (and, but for Mistral,
the GGUF file, which llama.cpp reads alike) with them too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import prepare_tiny_corpus, tiny_config

from pellucid import LLM
from pellucid.train.export import export_checkpoint
from pellucid.train.trainer import Trainer

TEXT = "The king and the queen walk to the river"  # 41 bytes: longer than the window
WINDOW = 6
FAMILIES = {  # arch -> (extra TrainConfig fields, transformers' class)
    "llama": ({}, "LlamaForCausalLM"),  # the default: what the others differ from
    "qwen2": ({}, "Qwen2ForCausalLM"),
    "qwen3": ({}, "Qwen3ForCausalLM"),
    "mistral": ({"sliding_window": WINDOW}, "MistralForCausalLM"),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_corpus(tmp_path_factory.mktemp("families"), "byte")


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, data: Path, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    extra, _ = FAMILIES[arch]
    out = tmp_path_factory.mktemp(arch) / "run"
    config = tiny_config(data, out, arch=arch, block_size=48, max_iters=20, **extra)
    trainer = Trainer(config, verbose=False)
    trainer.run()
    return arch, trainer, out


def trained_logits(trainer: Trainer, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return trainer.model.eval()(torch.tensor([ids]))[0]


def test_the_hf_folder_is_its_family_for_transformers_and_pellucid(trained, tmp_path: Path):
    import transformers

    arch, trainer, run = trained
    folder = export_checkpoint(run, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"] == [FAMILIES[arch][1]]
    llm = LLM(folder, dtype="float32")
    ids = llm.encode(TEXT)
    assert len(ids) > 2 * WINDOW
    ours = trained_logits(trainer, ids)
    hf_class = getattr(transformers, FAMILIES[arch][1])
    hf = hf_class.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(llm.logits(ids), ours, rtol=1e-5, atol=1e-5)


def test_what_makes_each_family_is_trained_and_used(trained):
    arch, trainer, _ = trained
    model, ids = trainer.model, list(range(40, 80))
    attn = model.layers[0].self_attn
    if arch == "qwen2":
        assert attn.qkv_proj.bias is not None and attn.qkv_proj.bias.abs().sum() > 0
    elif arch == "qwen3":
        assert not torch.equal(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))
    elif arch == "mistral":  # the window changes what a late position sees
        full = trained_logits(trainer, ids)
        for layer in model.layers:
            layer.self_attn.window = None
        try:
            assert not torch.allclose(trained_logits(trainer, ids)[-1], full[-1])
        finally:
            for layer in model.layers:
                layer.self_attn.window = WINDOW


def test_gguf_export_of_each_family(trained, tmp_path: Path):
    import gguf

    arch, trainer, run = trained
    if arch == "mistral":  # llama.cpp's llama architecture, Mistral's in GGUF, has no window
        with pytest.raises(ValueError, match="no sliding window"):
            export_checkpoint(run, tmp_path / "model.gguf")
        return
    path = export_checkpoint(run, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch
    llm = LLM(path, dtype="float32")
    ids = llm.encode(TEXT)
    ours = trained_logits(trainer, ids)
    torch.testing.assert_close(llm.logits(ids), ours, rtol=1e-5, atol=1e-5)

    llama_cpp = pytest.importorskip("llama_cpp")  # installed by `make bench`
    f32 = llama_cpp.GGML_TYPE_F32  # its default f16 K/V cache alone puts it ~2e-3 off
    ref = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32
    )
    assert ref.tokenize(TEXT.encode(), add_bos=False) == ids
    ref.eval(ids)
    theirs = torch.tensor(ref.scores[: len(ids)])
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_a_window_is_mistrals_alone():
    with pytest.raises(ValueError, match="sliding_window is mistral's"):
        tiny_config(Path("d"), Path("o"), arch="mistral")
    with pytest.raises(ValueError, match="sliding_window is mistral's"):
        tiny_config(Path("d"), Path("o"), arch="qwen2", sliding_window=4)
