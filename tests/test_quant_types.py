"""GGUFs holding Q2_K, Q3_K, IQ4_NL or IQ4_XS matrices (tests/gguf_blocks.py): pellucid reads them
with the gguf package's dequantization and computes what llama.cpp computes from the same file
(tests/data/llama_cpp_quant_types.json); its fast path repacks them into its own int4/int8."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from gguf_blocks import IDS, Q, quantized_gguf
from helpers import centred_cosine, next_token_nll

from pellucid import LLM

LLAMA_CPP = json.loads((Path(__file__).parent / "data" / "llama_cpp_quant_types.json").read_text())


@pytest.mark.parametrize("name", list(LLAMA_CPP["types"]))
def test_quantized_types_compute_llama_cpps_logits(name, tmp_path):
    path = quantized_gguf(tmp_path, Q[name])
    ref = LLAMA_CPP["types"][name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["gguf_sha256"], (
        "tests/gguf_blocks.py wrote other bytes than llama.cpp's reference was made from: "
        "rerun tests/data/make_llama_cpp_quant_types.py"
    )
    ours = LLM(path, dtype="float32").logits(IDS)
    theirs = torch.tensor(ref["logits"])
    kept = ours[::3]
    # llama.cpp multiplies these blocks by activations rounded to 8 bits (Q8_K, Q8_0), which
    # moves its logits by up to ~0.03 here (their spread: ~0.3); a misread block moves them by
    # the whole spread
    assert (kept - theirs).abs().max() < 0.1
    assert centred_cosine(kept, theirs) > 0.999
    nll, fast_nll = next_token_nll(ours, IDS), next_token_nll(LLM(path).logits(IDS), IDS)
    assert abs(fast_nll - nll) < 0.01 * nll
