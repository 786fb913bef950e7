"""Writes llama_cpp_quant_types.json: llama.cpp's logits for the GGUFs of tests/gguf_blocks.py,
one per quantized type pellucid reads with gguf's dequantization but has no quantizer for (Q2_K,
Q3_K, IQ4_NL, IQ4_XS), with each file's sha256 (the test rebuilds the file and checks it is the
same). Run with llama-cpp-python installed (`pip install -e '.[bench]'`), from the repository root:
python tests/data/make_llama_cpp_quant_types.py"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: gguf_blocks

from gguf_blocks import IDS, SCALES, quantized_gguf

POSITIONS = slice(None, None, 3)  # the logits kept: every third position, the whole vocabulary


def reference(path: Path) -> dict:
    f32 = llama_cpp.GGML_TYPE_F32  # float32 K/V: the cache adds no error of its own
    model = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32
    )
    model.eval(IDS)
    logits = np.asarray(model.scores[: len(IDS)], dtype=np.float32)[POSITIONS]
    return {
        "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "logits": [[round(float(x), 5) for x in row] for row in logits],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        types = {kind.name: reference(quantized_gguf(Path(tmp), kind)) for kind in SCALES}
    out = {
        "source": f"llama-cpp-python {llama_cpp.__version__} (float32 KV cache, 1 thread); "
        "tests/data/make_llama_cpp_quant_types.py",
        "ids": IDS,
        "positions": "every third",
        "types": types,
    }
    path = Path(__file__).with_name("llama_cpp_quant_types.json")
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
