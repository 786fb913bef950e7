"""The model's recommended sampling: read from its files or the catalog, used by the server for
what a request leaves out, and never over what a request names."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pellucid import LLM
from pellucid.errors import ModelLoadError
from pellucid.loading import sampling_defaults
from pellucid.server.params import Prompt, sampling_params
from pellucid.server.protocol import ChatCompletionRequest
from pellucid.structured.chat_request import CALL_SAMPLING


def test_gguf_keys_are_llama_cpps() -> None:
    metadata = {
        "general.sampling.temp": 0.6,
        "general.sampling.top_k": 20,
        "general.sampling.top_p": 0.95,
        "general.sampling.penalty_repeat": 1.05,
        "general.name": "x",
    }
    assert sampling_defaults.from_gguf(metadata) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.05,
    }


def test_generation_config_json(tmp_path: Path) -> None:
    assert sampling_defaults.from_hf_folder(tmp_path) == {}
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": None, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults.from_hf_folder(tmp_path) == {"temperature": 0.7, "top_p": 0.8}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json is not valid JSON"):
        sampling_defaults.from_hf_folder(tmp_path)


def test_a_request_names_what_it_wants_and_the_model_fills_the_rest() -> None:
    llm = SimpleNamespace(
        engine=SimpleNamespace(max_model_len=100),
        sampling_defaults={"temperature": 0.2, "top_p": 0.9},
    )
    prompt = Prompt([1, 2, 3], "")
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    (left_out,) = sampling_params(llm, ChatCompletionRequest(**ask), prompt, None, None)
    assert (left_out.temperature, left_out.top_p) == (0.2, 0.9)
    named = ChatCompletionRequest(**ask, temperature=0, top_p=1.0)
    (given,) = sampling_params(llm, named, prompt, None, None)
    assert (given.temperature, given.top_p) == (0.0, 1.0)
    llm.sampling_defaults = {}  # pellucid serve --sampling-defaults openai
    (openai_like,) = sampling_params(llm, ChatCompletionRequest(**ask), prompt, None, None)
    assert (openai_like.temperature, openai_like.top_p) == (1.0, 1.0)


def test_smollm2_gets_its_model_cards_settings(smollm2: LLM) -> None:
    # The GGUF carries no general.sampling keys; the catalog has the card's generate() example.
    assert smollm2.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}


def test_a_reply_that_must_be_calls_gets_call_sampling_unless_it_names_its_own() -> None:
    llm = SimpleNamespace(
        engine=SimpleNamespace(max_model_len=100), sampling_defaults={"temperature": 0.2}
    )
    prompt = Prompt([1, 2, 3], "", True, defaults=dict(CALL_SAMPLING))
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    (params,) = sampling_params(llm, ChatCompletionRequest(**ask), prompt, None, None)
    # Greedy, a new draw at the model's temperature, the penalty counted call by call
    assert (params.temperature, params.redraw_temperature) == (0.0, 0.2)
    assert params.frequency_penalty == CALL_SAMPLING["frequency_penalty"]
    assert params.penalties_per_block
    # What the request names keeps OpenAI's meaning
    named = ChatCompletionRequest(**ask, frequency_penalty=0, temperature=0.7)
    (params,) = sampling_params(llm, named, prompt, None, None)
    assert (params.frequency_penalty, params.penalties_per_block) == (0, False)
    assert (params.temperature, params.redraw_temperature) == (0.7, None)
