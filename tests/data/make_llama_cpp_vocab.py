"""Writes llama_cpp_vocab.json: how llama.cpp (llama-cpp-python 0.3.36) treats tokens it knows by
their spelling, on the two default GGUF models: its end-of-generation ids, and the ids of texts that
hold such spellings, with and without parse_special. Run with llama-cpp-python installed
(`pip install -e '.[bench]'`): python tests/data/make_llama_cpp_vocab.py"""

from __future__ import annotations

import json
from pathlib import Path

import llama_cpp

from pellucid import catalog

# spellings llama.cpp retypes or stops on (src/llama-vocab.cpp), each inside text and alone
SPELLINGS = [
    "</s>", "<eos>", "<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>",
    "<EOT>", "[EOT]", "[EOS]", "<|fim_prefix|>", "<PRE>", "<PAD>", "<|file_sep|>", "<|channel|>",
]  # fmt: skip
TEXTS = [s for sp in SPELLINGS for s in (sp, f"a{sp}b", f"x {sp} y\n{sp}{sp}")]


def reference(path: Path) -> dict:
    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    return {
        "eog_ids": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "texts": [
            {
                "text": text,
                "ids_parse_special_false": model.tokenize(
                    text.encode(), add_bos=False, special=False
                ),
                "ids_parse_special_true": model.tokenize(
                    text.encode(), add_bos=False, special=True
                ),
            }
            for text in TEXTS
        ],
    }


def main() -> None:
    out = {
        "source": "llama-cpp-python " + llama_cpp.__version__ + ", vocab_only; tests/data/make_llama_cpp_vocab.py",
        "models": {name: reference(catalog.resolve(name)) for name in ("smollm2-135m", "gemma3-270m")},
    }  # fmt: skip
    path = Path(__file__).with_name("llama_cpp_vocab.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
