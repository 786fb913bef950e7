"""The OpenAI-compatible server, driven by the official `openai` client on 127.0.0.1.

One uvicorn server (SmolLM2, an API key) runs in a background thread for the whole module; the
fuzzing test starts its own on a 32-token context so every generation stays short. Greedy answers
are compared with the same request run alone through `LLM` (holding the engine thread's lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import schemathesis
from helpers import KEY, MODEL, Running, serving
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from pellucid import LLM, SamplingParams
from pellucid.config import EngineConfig
from pellucid.server import create_app
from pellucid.server.limits import ServerLimits

HELLO = [{"role": "user", "content": "Say hello to Paris."}]
# The full checks: PELLUCID_DISCONNECTS=200 PELLUCID_FUZZ_EXAMPLES=500 (minutes, not seconds).
DISCONNECTS = int(os.environ.get("PELLUCID_DISCONNECTS", "40"))
FUZZ_EXAMPLES = int(os.environ.get("PELLUCID_FUZZ_EXAMPLES", "50"))


def alone(server: Running, llm: LLM, messages: list[dict], max_tokens: int) -> str:
    """The greedy reply of `messages` run by itself, borrowing the engine from the server thread."""
    with server.state.engine.lock:
        return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens)).text


def metric(server: Running, name: str, label: str = "") -> float:
    """A value from /metrics; a labelled counter that has never counted reads 0."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(
        rf"^pellucid:{name}(?:_total)?\{{[^}}]*{label}[^}}]*\}} (\S+)$", text, re.MULTILINE
    )
    if match is None and label:
        return 0.0
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(server: Running, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "num_requests_running") or metric(server, "kv_cache_used_tokens"):
        assert time.monotonic() < deadline, "requests still running after the client left"
        time.sleep(0.2)


# --- models, keys, health ------------------------------------------------------------------
def test_models_lists_the_loaded_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve("SmolLM2-135M-Instruct.Q4_1.gguf").id == MODEL


def test_wrong_or_missing_key_is_401(server: Running) -> None:
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    response = httpx.get(server.url + "/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)


def test_health_and_metrics_need_no_key(server: Running) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "generation_tokens_total",
    ):
        assert f"pellucid:{name}" in text


# --- chat ----------------------------------------------------------------------------------
def test_chat_matches_the_engine_alone(
    server: Running, client: openai.OpenAI, smollm2: LLM
) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=HELLO, max_tokens=8, temperature=0
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == alone(server, smollm2, HELLO, 8)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens == len(smollm2.chat_prompt(HELLO))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_stream_with_usage(server: Running, client: openai.OpenAI, smollm2: LLM) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone(server, smollm2, HELLO, 8)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_completion_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "backslashreplace") == entry.token
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_stop_string_ends_the_reply_before_it(
    server: Running, client: openai.OpenAI, smollm2: LLM
) -> None:
    full = alone(server, smollm2, HELLO, 12)
    words = full.split()
    stop = words[len(words) // 2]
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stop=[stop, "\n\n\n"]
    )
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_n_choices_with_a_seed_differ_and_repeat(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=7, temperature=1.5
        )
        assert [c.index for c in reply.choices] == [0, 1]
        return [c.message.content for c in reply.choices]

    first = ask()
    assert first[0] != first[1]
    assert ask() == first


def test_every_sampling_knob_is_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=1,
        stop="\n\n",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 3


def test_concurrent_streams_each_equal_the_request_alone(
    server: Running, client: openai.OpenAI, smollm2: LLM
) -> None:
    conversations = [[{"role": "user", "content": f"Count to {i}."}] for i in range(8)]
    expected = [alone(server, smollm2, m, 6) for m in conversations]

    def stream(messages: list[dict]) -> str:
        chunks = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(stream, conversations)) == expected


def test_llm_calls_on_the_served_model_take_turns_with_the_server(
    server: Running, client: openai.OpenAI, smollm2: LLM
) -> None:
    # Called from another thread while requests are in flight, `generate` and `stream` once
    # stepped the engine alongside the server's thread: a sequence was advanced twice, and every
    # later step of the server failed. Each side must get its own tokens, as if run alone.
    conversations = [[{"role": "user", "content": f"Name {i} colours."}] for i in range(4)]
    expected = [alone(server, smollm2, m, 12) for m in conversations]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["The capital of France is", "1, 2, 3,"]
    want = [o.text for o in smollm2.generate(prompts, greedy)]

    def ask(messages: list[dict]) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        replies = pool.map(ask, conversations * 2)
        direct = [[o.text for o in smollm2.generate(prompts, greedy)] for _ in range(3)]
        streamed = "".join(o.delta for o in smollm2.stream(prompts[0], greedy))
        assert list(replies) == expected * 2
    assert direct == [want] * 3 and streamed == want[0]


# --- completions ---------------------------------------------------------------------------
def test_completion_echo_and_logprobs(client: openai.OpenAI, smollm2: LLM) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    n_prompt = len(smollm2.encode(prompt))
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 3
    # the prompt's own tokens are scored (test_scoring.py checks the values), the first is null
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) <= 2 for top in lp.top_logprobs[n_prompt:])
    assert reply.usage.prompt_tokens == n_prompt and reply.usage.completion_tokens == 3


def test_completion_prompts_as_lists_and_token_ids(client: openai.OpenAI, smollm2: LLM) -> None:
    text = "Once upon a time"
    by_text = client.completions.create(
        model=MODEL, prompt=[text, "Hello"], max_tokens=2, temperature=0
    )
    assert [c.index for c in by_text.choices] == [0, 1]
    ids = [smollm2.encode(text), smollm2.encode("Hello")]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=2, temperature=0)
    assert one.choices[0].text == by_text.choices[0].text


def test_completion_stream(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


# --- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"n": 0},
        {"max_tokens": 0},
        {"top_logprobs": 3},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": [""]},
        {"presence_penalty": 3},
        {"extra_body": {"top_k": -5}},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"extra_body": {"logit_bias": {"1": 5}}},
        {"tools": [{"type": "function"}]},
    ],
)
def test_bad_parameters_are_400(client: openai.OpenAI, bad: dict) -> None:
    kwargs = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    assert e.value.body["message"]


def test_context_overflow_is_400_and_says_the_limit(client: openai.OpenAI, smollm2: LLM) -> None:
    limit = smollm2.engine.max_model_len
    with pytest.raises(openai.BadRequestError, match=str(limit)) as e:
        client.completions.create(model=MODEL, prompt=[1] * limit, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=str(limit)):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=limit)


def test_bad_completion_prompts_are_400(client: openai.OpenAI) -> None:
    for prompt in ("", [], [[]], [10**9]):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)


def test_malformed_json_is_an_openai_shaped_400(server: Running) -> None:
    response = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@contextlib.contextmanager
def limited(server: Running, max_sequences: int | None = None, **limits: object) -> Iterator[None]:
    """Tighter limits for the duration of a test; the server's own are restored after it."""
    state = server.state
    saved = state.limits, state.engine.max_sequences
    state.limits = state.engine.limits = dataclasses.replace(state.limits, **limits)
    state.engine.max_sequences = max_sequences or saved[1]
    try:
        yield
    finally:
        state.limits = state.engine.limits = saved[0]
        state.engine.max_sequences = saved[1]


@contextlib.contextmanager
def held_stream(server: Running, max_tokens: int = 300) -> Iterator[None]:
    """A streaming request that keeps decoding while the test runs, then is dropped."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        next(lines)  # the role chunk: the request is in flight
        yield
    wait_until_idle(server)


def test_full_queue_is_429_with_retry_after(server: Running, client: openai.OpenAI) -> None:
    before = metric(server, "request_rejected", 'reason="queue_full"')
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    with limited(server, max_sequences=1), held_stream(server):
        response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 429
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert "retry" in response.json()["error"]["message"]
        assert metric(server, "num_requests_in_flight") == 1
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        # the explorer's passes go through the engine too: refused alike
        for path, explore in (
            ("inspect", {"tokens": [1, 2], "position": 1}),
            ("patching", {"clean": "a b", "corrupted": "a c"}),
        ):
            response = httpx.post(f"{server.url}/v1/{path}", json=explore, headers=headers)
            assert response.status_code == 429, path
    assert metric(server, "request_rejected", 'reason="queue_full"') == before + 4
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).choices


def test_tokens_in_flight_bound_is_429_and_a_request_over_it_alone_is_400(
    server: Running, client: openai.OpenAI
) -> None:
    with limited(server, max_tokens_in_flight=400), held_stream(server, max_tokens=300):
        assert 300 < metric(server, "num_tokens_in_flight") <= 400  # prompt + max_tokens
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=100)
        assert "tokens" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=500)
        assert e.value.body["param"] == "max_tokens"


def test_a_request_not_started_within_the_queue_timeout_is_cancelled(
    server: Running, client: openai.OpenAI, smollm2: LLM
) -> None:
    before = metric(server, "request_rejected", 'reason="queue_timeout"')
    config = smollm2.engine.config
    config.max_num_seqs = 1  # the held stream runs; the next request can only wait
    try:
        with limited(server, queue_timeout_s=0.5), held_stream(server):
            start = time.monotonic()
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
            assert time.monotonic() - start < 10
            assert e.value.status_code == 503
            assert e.value.body["code"] == "queue_timeout"
            assert e.value.response.headers["Retry-After"] == "1"
            assert metric(server, "num_requests_in_flight") == 1  # the timed-out one is gone
    finally:
        config.max_num_seqs = 64
    assert metric(server, "request_rejected", 'reason="queue_timeout"') == before + 1


def test_stopped_engine_is_503_until_restarted(server: Running, client: openai.OpenAI) -> None:
    server.state.engine.stop()
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        assert e.value.status_code == 503
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.state.engine.start()
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).choices


# --- disconnects ---------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_kv_cache(server: Running) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 500,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        # Keep the line iterator referenced: dropping it early closes the connection already.
        lines = response.iter_lines()
        contents = 0
        while contents < 2:
            line = next(lines)
            if line.startswith("data: {"):
                contents += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
        assert metric(server, "num_requests_running") == 1
        assert metric(server, "kv_cache_used_tokens") > 0
    wait_until_idle(server)  # closing the stream aborted the request


def drop_one(server: Running, i: int) -> None:
    """Leave request i at a random point: before the first token, mid-stream, or while waiting
    for a whole answer; some ask for two choices."""
    rng = random.Random(i)
    kind = rng.choice(["early", "stream", "whole"])
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a story #{i}"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "n": rng.choice([1, 2]),
        "stream": kind != "whole",
    }
    url, headers = server.url + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    if kind == "whole":
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=body, headers=headers, timeout=rng.uniform(0.05, 1.5))
        return
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(0 if kind == "early" else rng.randint(1, 12)):
            next(lines)


def test_random_disconnects_leave_no_kv_blocks_in_use(server: Running) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: drop_one(server, i), range(DISCONNECTS)))
    wait_until_idle(server)
    assert metric(server, "num_requests_waiting") == 0


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_kv_cache(server: Running) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=2)
    wait_until_idle(server)


# --- fuzzing -------------------------------------------------------------------------------
@pytest.mark.slow  # loads SmolLM2 for its own server
def test_fuzzing_the_openapi_schema_finds_no_server_error() -> None:
    """schemathesis generates valid and invalid requests from /openapi.json: none may get a 5xx.
    A 48-token context keeps every generation short (a chat prompt alone takes ~35 tokens of it)
    and two sequences at most; the engine thread stops with uvicorn."""
    llm = LLM(MODEL, max_model_len=48, engine=EngineConfig(max_num_seqs=2))
    app = create_app(llm, model_name=MODEL, limits=ServerLimits(max_waiting=0))
    with serving(app) as running:
        schema = schemathesis.openapi.from_url(running.url + "/openapi.json")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=schema.as_strategy(generation_mode=mode))
            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def no_server_error(case: schemathesis.Case) -> None:
                response = case.call(base_url=running.url, timeout=120)
                assert response.status_code < 500, (
                    f"{case.method} {case.path} -> {response.status_code} {response.text[:500]}\n"
                    f"{case.as_curl_command()}"
                )

            no_server_error()
    assert not app.state.pellucid.engine.is_running
