"""Scoring a prompt's own tokens: `LLM.prompt_logprobs`, and `/v1/completions` with `echo`,
`logprobs` and `max_tokens: 0` (OpenAI's legacy format, as lm-evaluation-harness reads it),
against the model's full-forward logits."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from helpers import KEY, MODEL

from pellucid import LLM
from pellucid.config import EngineConfig

TEXTS = ["The capital of France is Paris.", "Water boils at 100 degrees Celsius at sea level."]


def reference(llm: LLM, text: str) -> list[float]:
    """logprob of token i + 1 after tokens 0..i, from one plain forward pass."""
    ids = llm.encode(text)
    logprobs = llm.logits(ids).log_softmax(-1)
    return [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_prompt_logprobs_are_the_full_forwards(tiny_path):
    tiny = LLM(tiny_path, dtype="float32", engine=EngineConfig(max_num_batched_tokens=64))
    long = "abcdefghij" * 40  # 400 tokens: several pre-fill chunks and LM-head slices
    scored = tiny.prompt_logprobs([*TEXTS, long], top_n=4)
    for text, rows in zip([*TEXTS, long], scored, strict=True):
        ids = tiny.encode(text)
        assert [r.token_id for r in rows] == ids[1:]
        assert torch.allclose(
            torch.tensor([r.logprob for r in rows]), torch.tensor(reference(tiny, text)), atol=1e-4
        )
        assert all(len(r.top) == 4 and r.top[0][1] >= r.logprob - 1e-6 for r in rows)


def test_echo_with_max_tokens_0_scores_each_prompt(client, smollm2):
    reply = client.completions.create(
        model=MODEL, prompt=TEXTS, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    assert [c.text for c in reply.choices] == TEXTS
    assert reply.usage.completion_tokens == 0
    for text, choice in zip(TEXTS, reply.choices, strict=True):
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert torch.allclose(
            torch.tensor(lp.token_logprobs[1:]), torch.tensor(reference(smollm2, text)), atol=1e-4
        )
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert choice.finish_reason == "length"


def test_echo_scores_the_prompt_before_a_completion_streamed_or_not(client, server, smollm2):
    whole = client.completions.create(
        model=MODEL, prompt=TEXTS[0], echo=True, logprobs=1, max_tokens=3, temperature=0
    )
    lp = whole.choices[0].logprobs
    n_prompt = len(smollm2.encode(TEXTS[0]))
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert torch.allclose(
        torch.tensor(lp.token_logprobs[1:n_prompt]),
        torch.tensor(reference(smollm2, TEXTS[0])),
        atol=1e-4,
    )
    body = {
        "model": MODEL,
        "prompt": TEXTS[0],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    (chunk,) = [json.loads(e) for e in events[:-1]]
    assert chunk["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        lp.token_logprobs[1:n_prompt], abs=1e-5
    )


def test_max_tokens_below_zero_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)


def test_the_tokenizer_is_served_where_vllm_serves_it(server, smollm2):
    """lm-evaluation-harness's remote tokenizer: /tokenizer_info, /tokenize and /detokenize at the
    root (vLLM's places), behind the API key like the rest."""
    auth = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(server.url + "/tokenizer_info", headers=auth, timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and "chat_template" in info
    ids = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "Hello world", "add_special_tokens": False},
        headers=auth,
        timeout=30,
    ).json()["tokens"]
    assert ids == smollm2.tokenizer.encode("Hello world", add_special=False, parse_special=True)
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=auth, timeout=30)
    assert text.json()["prompt"] == "Hello world"
    assert httpx.get(server.url + "/tokenizer_info", timeout=30).status_code == 401
