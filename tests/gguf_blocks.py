"""GGUFs whose matrices are stored in a quantized type pellucid has no quantizer for (Q2_K, Q3_K,
IQ4_NL, IQ4_XS), made without one: every block gets random bits and small random float16 scales
(any bits make a valid block), from a fixed seed, so the same call writes the same bytes. llama.cpp's
logits of those files are in tests/data/llama_cpp_quant_types.json
(tests/data/make_llama_cpp_quant_types.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from pellucid import LLM
from pellucid.train.char_tokenizer import byte_tokenizer, save_tokenizer
from pellucid.train.gguf_export import export_gguf

Q = GGMLQuantizationType
# where each block's float16 scales lie, in the layouts of gguf-py's quants.py (= ggml's structs),
# and their largest value: the weights' size is about that times the largest sub-block scale times
# the largest code (Q2_K: 15 x 3, Q3_K: 32 x 4, IQ4_NL: 127, IQ4_XS: 32 x 127), kept near 0.1-0.2
SCALES = {
    Q.Q2_K: ((80, 82), 4e-3),
    Q.Q3_K: ((108,), 1e-3),
    Q.IQ4_NL: ((0,), 1e-3),
    Q.IQ4_XS: ((0,), 4e-5),
}
# rows of 256 features: the K-quants' and IQ4_XS's block
SHAPE = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
IDS = [(7 * i * i + 3 * i + 11) % 256 for i in range(24)]


def float_gguf(folder: Path) -> Path:
    """A Llama of SHAPE with random weights (seed 0), as pellucid exports it: float32 tensors."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    model.save_pretrained(folder / "hf")
    save_tokenizer(byte_tokenizer(), folder / "hf")
    llm = LLM(folder / "hf", dtype="float32")
    return export_gguf(llm.model, folder / "hf", folder / "float.gguf")


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, rng) -> np.ndarray:
    """(rows, bytes per row) of random blocks, their float16 scales up to SCALES' bound."""
    block, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    offsets, largest = SCALES[kind]
    for at in offsets:
        scales = rng.uniform(largest / 4, largest, size=len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def quantized_gguf(folder: Path, kind: GGMLQuantizationType) -> Path:
    """float_gguf's file with every matrix of its blocks replaced by random `kind` blocks."""
    reader = GGUFReader(float_gguf(folder))
    path = folder / f"{kind.name}.gguf"
    writer = GGUFWriter(path, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        array = field.types[0] == GGUFValueType.ARRAY
        sub = field.types[-1] if array else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.data.shape) == 2:
            rows, cols = t.data.shape
            writer.add_tensor(t.name, random_blocks(kind, rows, cols, rng), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
