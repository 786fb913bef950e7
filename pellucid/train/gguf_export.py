"""Export a trained model (Llama, Qwen2, Qwen3 or GPT-2) as a float32 GGUF file with the `gguf`
package's writer.

llama.cpp's layout: tensors named `blk.N.attn_q.weight` etc., Llama's Q/K rows permuted for its
interleaved RoPE (pellucid's loader un-permutes them; Qwen's are stored as they are); GPT-2's `attn_qkv` and `position_embd`, with zero
biases where it was trained without; the tokenizer as a 'gpt2' byte-level BPE vocabulary:
tokens spelled in GPT-2's byte alphabet plus merges. A character-level vocabulary fits that form
when every character is one byte (ASCII); a byte-level or trained BPE one always does.

    pellucid export runs/baby --out models/baby.gguf
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from torch import Tensor

from pellucid.atomic import atomic_path
from pellucid.loading.fused import unfused_state
from pellucid.loading.gguf_loader import BLOCK_NAMES, FFN_NORM, GLOBAL_NAMES
from pellucid.models.config import ModelConfig
from pellucid.models.llama import LlamaModel
from pellucid.tokenizer.gguf_vocab import NO_MERGES
from pellucid.train.char_tokenizer import gpt2_byte_alphabet
from pellucid.train.hf_export import llama_family, with_biases

# The loader's name tables read backwards. The norm before the MLP, which Llama and GPT-2 call
# post_attention_layernorm, is llama.cpp's ffn_norm (Gemma's post_attention_norm is not exported).
NAMES = {ours: part for part, ours in BLOCK_NAMES.items()} | {FFN_NORM["llama"]: "ffn_norm"}
GLOBAL = {ours: name for name, ours in GLOBAL_NAMES.items()}
NORMAL, CONTROL = 1, 3  # tokenizer.ggml.token_type values


def gguf_name(ours: str) -> str:
    """layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight."""
    if ours in GLOBAL:
        return GLOBAL[ours]
    _, layer, rest = ours.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def permute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Rotate-half rows -> llama.cpp's interleaved pairs (its converter's `permute`)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def gguf_vocab(tokenizer_folder: Path) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens in GPT-2 byte spelling, token types, merges, tokenizer_config) of a saved tokenizer."""
    spec = json.loads((tokenizer_folder / "tokenizer.json").read_text(encoding="utf-8"))
    config_path = tokenizer_folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab = {**vocab, **special}
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    spell = dict(enumerate(gpt2_byte_alphabet()))
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        if byte_level or token in special:
            tokens[i] = token
        elif len(token.encode()) == 1:  # a character-level token: spell its byte as GPT-2 does
            tokens[i] = spell[token.encode()[0]]
        else:
            raise ValueError(
                f"character {token!r} is more than one byte: GGUF's byte-level vocabulary cannot "
                "hold this character tokenizer; export to an HF folder instead"
            )
    types = [CONTROL if t in special else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return tokens, types, merges, config


def export_gguf(model: LlamaModel, tokenizer_folder: Path, path: Path) -> Path:
    """An F32 GGUF file of the model and its tokenizer, which llama.cpp and pellucid read."""
    cfg = model.cfg
    family = "gpt2" if cfg.arch == "gpt2" else llama_family(cfg)
    if family == "mistral":
        raise ValueError(
            "llama.cpp reads Mistral as its llama architecture, which has no sliding window: "
            "export this model as an HF folder (--out a folder, not .gguf)"
        )
    if cfg.long_rope is not None or (cfg.rope_divisors is not None and family != "llama"):
        raise ValueError("GGUF export writes rope scaling for Llama 3's kind only")
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), family)
        _add_hyperparameters(writer, cfg, path.stem)
        _add_tokenizer(writer, tokenizer_folder)
        _add_tensors(writer, model, permute=family == "llama")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _add_hyperparameters(writer: gguf.GGUFWriter, cfg: ModelConfig, name: str) -> None:
    writer.add_name(name)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.arch == "gpt2":
        writer.add_layer_norm_eps(cfg.norm_eps)
        # llama.cpp's GPT-2 runs tanh-GELU; pellucid's loader reads the exact choice from here
        writer.add_string(f"{cfg.arch}.pellucid.hidden_act", cfg.hidden_act)
    else:
        writer.add_head_count_kv(cfg.n_kv_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_rope_dimension_count(cfg.head_dim)


def _add_tensors(writer: gguf.GGUFWriter, model: LlamaModel, permute: bool) -> None:
    """The tensors under llama.cpp's names; `permute`: Q/K rows in its interleaved RoPE order
    (Llama's layout; Qwen rotates halves, as pellucid does)."""
    cfg = model.cfg
    state = unfused_state(model)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # llama.cpp reuses token_embd when output.weight is absent
    if cfg.arch == "gpt2":
        state = with_biases(state)
    for name, t in state.items():
        if permute and name.endswith("q_proj.weight"):
            t = permute_rope(t, cfg.n_heads)
        elif permute and name.endswith("k_proj.weight"):
            t = permute_rope(t, cfg.n_kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(t.numpy()))
    if cfg.rope_divisors is not None:  # Llama 3.1's scaling, as llama.cpp's converter writes it
        writer.add_tensor("rope_freqs.weight", np.asarray(cfg.rope_divisors, dtype=np.float32))


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    tokens, types, merges, config = gguf_vocab(folder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges or [NO_MERGES])  # char/byte vocabularies have no merges
    writer.add_add_bos_token(False)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        if config.get(key) in tokens:
            add(tokens.index(config[key]))
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])
