"""Writes llama_cpp_families.json: llama.cpp's logits and greedy tokens for the random-weight model
of each family in tests/families.py, read from the GGUF llama.cpp's own converter makes of its
Hugging Face folder (whose sha256 the test checks, so both sides read the same bytes). Run with
llama-cpp-python installed (`pip install -e '.[bench]'`), from the repository root:
python tests/data/make_llama_cpp_families.py"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: families, llama_cpp_source

from families import GGUF_SETTINGS, IDS, PROMPTS, converted

COLUMNS = 64  # logits kept per position: every (vocab // COLUMNS)-th token id
GREEDY_TOKENS = 32


def run(path: Path) -> llama_cpp.Llama:
    # float32 K and V: llama.cpp's default f16 cache alone puts its logits ~2e-3 off
    return llama_cpp.Llama(
        str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, seed=0,
    )  # fmt: skip


def greedy(model: llama_cpp.Llama, prompt: list[int]) -> list[int]:
    model.reset()
    model.eval(prompt)
    out = []
    for _ in range(GREEDY_TOKENS):
        out.append(int(np.argmax(model.scores[model.n_tokens - 1])))
        model.eval(out[-1:])
    return out


def reference(name: str, folder: Path) -> dict:
    _, path = converted(name, GGUF_SETTINGS[name], folder)
    model = run(path)
    model.eval(IDS)
    logits = np.asarray(model.scores[: len(IDS)], dtype=np.float32)
    step = logits.shape[1] // COLUMNS
    return {
        "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "column_step": step,
        "logits": [[round(float(x), 6) for x in row[::step][:COLUMNS]] for row in logits],
        "argmax": [int(i) for i in logits.argmax(-1)],
        "greedy": [greedy(model, p) for p in PROMPTS],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        families = {name: reference(name, Path(tmp) / name) for name in GGUF_SETTINGS}
    out = {
        "source": f"llama-cpp-python {llama_cpp.__version__} (float32 KV cache, 1 thread); "
        "tests/data/make_llama_cpp_families.py",
        "ids": IDS,
        "prompts": PROMPTS,
        "families": families,
    }
    path = Path(__file__).with_name("llama_cpp_families.json")
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
