"""Checkpoint loading: Hugging Face folders against transformers itself, and bad files."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pellucid.errors import ModelLoadError
from pellucid.loading.config import config_from_gguf
from pellucid.loading.loader import build_from_state, read_checkpoint
from pellucid.weights import cache as weight_cache
from pellucid.weights.gguf_file import GGUFFile


def tiny_hf_model(tmp_path, kind: str):
    """A randomly initialized transformers model saved as an HF folder (config + safetensors).
    (transformers is imported here: the bad-file tests below do without it.)"""
    import transformers

    torch.manual_seed(0)
    common = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Gemma3TextConfig(
            **common, head_dim=32, sliding_window=8, query_pre_attn_scalar=32
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # Gemma's norms start at zero: give them values so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.eval().save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_hf_folder_logits_equal_transformers(tmp_path, kind):
    hf, folder = tiny_hf_model(tmp_path, kind)
    ckpt = read_checkpoint(folder)
    ours = build_from_state(ckpt.config, ckpt.state, torch.float32, str(folder))
    ids = torch.randint(0, 300, (1, 24))  # longer than Gemma's window of 8
    with torch.no_grad():
        expected = hf(ids).logits
    assert torch.allclose(ours(ids), expected, atol=1e-4, rtol=1e-4)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(bad)


def test_truncated_gguf(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(50_000_000))  # about half of the file
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as err:
        read_checkpoint(cut)
    assert str(cut) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        read_checkpoint(tmp_path / "nothing.gguf")


def test_unknown_architecture():
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        config_from_gguf({"general.architecture": "mamba"}, "x.gguf")


def test_gguf_yarn_without_its_original_context_is_a_load_error():
    """A rope scaling that needs a key the file lacks stops the load naming the key."""
    meta = {"general.architecture": "qwen2", "qwen2.rope.scaling.type": "yarn"}
    meta |= {f"qwen2.{k}": v for k, v in [("attention.head_count", 4), ("embedding_length", 64)]}
    meta |= {f"qwen2.{k}": v for k, v in [("block_count", 1), ("feed_forward_length", 8)]}
    meta |= {"qwen2.attention.layer_norm_rms_epsilon": 1e-6, "qwen2.context_length": 64}
    meta |= {"qwen2.vocab_size": 10, "qwen2.rope.scaling.factor": 4.0}
    with pytest.raises(ModelLoadError, match="lacks qwen2.rope.scaling.original_context_length"):
        config_from_gguf(meta, "x.gguf")


def test_hf_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError):
        read_checkpoint(tmp_path)


def test_hf_folder_with_corrupt_safetensors(tmp_path):
    _, folder = tiny_hf_model(tmp_path, "llama")
    f = next(folder.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        read_checkpoint(folder)
    shutil.rmtree(folder)


def test_second_load_comes_from_the_cache(tmp_path, smollm2_path, monkeypatch):
    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copy(smollm2_path, gguf)
    first = read_checkpoint(gguf)
    assert (weight_cache.entry_dir(gguf) / "model.safetensors").is_file()
    # A hit must not open the GGUF at all
    monkeypatch.setattr("pellucid.loading.loader.GGUFFile", _refuse)
    second = read_checkpoint(gguf)
    assert second.config == first.config and second.gguf_metadata == first.gguf_metadata
    assert second.state.keys() == first.state.keys()
    for name, t in first.state.items():
        assert torch.equal(second.state[name], t), name


def test_an_edited_file_or_a_damaged_entry_misses(tmp_path, smollm2_path, monkeypatch):
    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copy(smollm2_path, gguf)
    read_checkpoint(gguf)
    entry = weight_cache.entry_dir(gguf)
    (entry / "model.safetensors").write_bytes(b"not safetensors")
    assert weight_cache.load(gguf) is None
    read_checkpoint(gguf)  # loads from the GGUF and repairs the entry
    assert weight_cache.load(gguf) is not None
    os.utime(gguf, ns=(0, 0))  # a new modification time: another key
    assert weight_cache.entry_dir(gguf) != entry and weight_cache.load(gguf) is None
    read_checkpoint(gguf)
    assert weight_cache.load(gguf) is not None and not entry.exists()  # the stale one went


def test_copies_of_a_file_at_two_paths_keep_an_entry_each(tmp_path, smollm2_path, monkeypatch):
    """Two installs of one model (two virtual environments) are two files of one name: storing
    one's entry must not delete the other's, or each load would convert the file again."""
    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for copy in (first, second):
        copy.parent.mkdir()
        shutil.copy(smollm2_path, copy)
        read_checkpoint(copy)
    assert weight_cache.entry_dir(first) != weight_cache.entry_dir(second)
    assert weight_cache.load(first) is not None and weight_cache.load(second) is not None


def test_the_cache_can_be_turned_off(tmp_path, smollm2_path, monkeypatch):
    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PELLUCID_NO_CACHE", "1")
    read_checkpoint(smollm2_path)
    assert not (tmp_path / "cache").exists()


def _refuse(path):
    raise AssertionError(f"opened {path} although its conversion is cached")


def test_header_reader_reads_what_the_gguf_package_reads(smollm2_path):
    """pellucid reads GGUF headers itself (the gguf package's reader takes seconds per 100k-token
    vocabulary): the same metadata values and the same tensor views as gguf.GGUFReader."""
    from gguf import GGUFReader

    ours = GGUFFile(smollm2_path)
    reader = GGUFReader(smollm2_path)
    theirs = {
        key: value.item() if isinstance(value := field.contents(), np.generic) else value
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }
    assert ours.metadata == theirs
    assert ours.tensor_names() == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = ours.raw(t.name)
        assert (mine.dtype, mine.shape, ours.tensor_type(t.name)) == (
            t.data.dtype,
            t.data.shape,
            t.tensor_type,
        )
        assert np.array_equal(mine, t.data)


def _pages_in_page_cache(file: Path) -> int:
    """How many of the file's pages the page cache holds: mincore over a mapping of it (a
    private one, which ctypes can address; no page of it is written)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size, page = file.stat().st_size, mmap.PAGESIZE
    vec = ctypes.create_string_buffer((size + page - 1) // page)
    with open(file, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        first = ctypes.c_char.from_buffer(mapped)
        failed = libc.mincore(ctypes.addressof(first), size, vec)
        del first  # the mapping cannot close while a ctypes object points into it
    if failed:
        pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_a_stored_packed_model_leaves_its_pages_out_of_the_page_cache(tmp_path, monkeypatch):
    """store_packed drops the file's pages once written: a later load then maps them by its own
    faults, a few pages at a time, where pages a write had left there came into the process in
    far larger runs (and showed as resident memory: weights/cache.py)."""
    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # the entry is keyed by the file's path, size and time only
    where = weight_cache.entry_dir(model)
    where.mkdir(parents=True)
    (where / "metadata.json").write_text("{}")
    control = where / "control.bin"  # written alike and kept: the page cache holds it
    control.write_bytes(os.urandom(8 << 20))
    if _pages_in_page_cache(control) == 0:
        pytest.skip("this filesystem leaves no written pages in the page cache")
    w = torch.randn(2 << 20)  # 8 MB
    weight_cache.store_packed(model, "packed", {"w": w})
    stored = where / "packed.pt"
    assert _pages_in_page_cache(stored) < stored.stat().st_size // mmap.PAGESIZE // 10
    assert torch.equal(weight_cache.load_packed(model, "packed")["w"], w)  # and whole
