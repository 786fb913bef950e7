"""Tools through the server: OpenAI `tools`, `tool_choice`, streamed `tool_calls`, and
`response_format`, driven by the official `openai` client and by smolagents as a real agent."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from helpers import KEY, MODEL, Running

from pellucid import LLM, SamplingParams
from pellucid.structured import prepare_chat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    """The default path, as `pellucid serve` runs it (int4, decode compiled ahead): its
    replies are the ones users get, and it decodes several times faster than float32. The
    conftest's `server` serves this one in this module."""
    return LLM(MODEL)


def _check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_the_server_runs_this_modules_model(server: Running, smollm2: LLM) -> None:
    assert server.state.llm is smollm2  # the default path's, not the conftest's float32 one


def test_required_tool_choice_gives_a_valid_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, CALC],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        parallel_tool_calls=False,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "calculator": CALC}[call.function.name]
    _check_call(call, tool)


def test_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, CALC],
        temperature=0,
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "calculator"}},
    )
    for call in r.choices[0].message.tool_calls:
        _check_call(call, CALC)


def test_streamed_tool_calls_equal_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 80,
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        for c in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole
    ]


OSLO = [{"role": "user", "content": "What's the weather in Oslo, in celsius?"}]
ORDER = {
    "type": "function",
    "function": {
        "name": "shop.place_order",  # a dot: pellucid takes names as given (OpenAI's do not)
        "description": "Order groceries.",
        "parameters": {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "quantity": {"type": "integer", "minimum": 1},
                            "unit": {"type": "string", "enum": ["piece", "kg"]},
                        },
                        "required": ["name", "quantity"],
                    },
                },
                "express": {"type": "boolean", "default": False},
            },
            "required": ["items"],
        },
    },
}


def _reply(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[list[tuple[str, dict]], str]:
    """(name, arguments) of each call and the finish_reason, from a whole or a streamed reply."""
    kwargs = {"model": MODEL, "temperature": 0, **kwargs}
    if not stream:
        return _calls(client.chat.completions.create(**kwargs).choices[0])
    parts: dict[int, dict] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = parts.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return [(c["name"], json.loads(c["arguments"])) for c in parts.values()], finish


def _calls(choice) -> tuple[list[tuple[str, dict]], str]:
    """(name, arguments) of each call of a whole reply's choice, and its finish_reason."""
    calls = choice.message.tool_calls or []
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls], (
        choice.finish_reason
    )


def _raw_calls(llm: LLM, messages: list[dict], max_tokens: int) -> list[dict]:
    """The calls greedy decoding writes under the required grammar, parallel calls allowed,
    when nothing filters them."""
    chat = prepare_chat(
        llm.tokenizer, messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=True
    )
    fields = chat.sampling_fields()
    del fields["distinct_blocks"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **fields)
    text = llm.generate([llm.encode_chat(chat.prompt)], params)[0].text
    return [
        json.loads(b)["arguments"] for b in re.findall(r"<tool_call>\n(.*)\n</tool_call>", text)
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, openai.omit])
def test_a_repeated_call_ends_the_reply(
    smollm2: LLM, client: openai.OpenAI, stream: bool, parallel: bool
) -> None:
    # Left alone, the model calls get_weather(Oslo, celsius) again and again. With parallel
    # calls asked for, the repeat ends the reply; left out (the client's default), SmolLM2's
    # template knows no parallel calls, and the grammar allows one.
    raw = _raw_calls(smollm2, OSLO, 300)
    assert len(raw) >= 3 and all(c == raw[0] for c in raw)
    calls, finish = _reply(
        client,
        stream,
        messages=OSLO,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=parallel,
    )
    assert calls == [("get_weather", raw[0])] and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_the_margin_forced_shut_is_left_out(
    smollm2: LLM, client: openai.OpenAI, stream: bool
) -> None:
    # In 80 tokens the second call starts, and the close margin shuts it with its city emptied.
    raw = _raw_calls(smollm2, ASK, 80)
    assert len(raw) == 2 and raw[0]["city"] == "Paris" and raw[1]["city"] == ""
    calls, finish = _reply(
        client,
        stream,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        parallel_tool_calls=True,
    )
    assert calls == [("get_weather", raw[0])] and finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_required_draws_again_then_keeps_the_forced_call(
    client: openai.OpenAI, stream: bool
) -> None:
    # In 40 tokens the close margin (32) shuts the only call, its city emptied, at every draw.
    # A sampled reply that must call is drawn again (twice), then keeps the call it has and
    # says "length". Left to the server, the first draw is greedy and the new ones sampled at
    # the model's temperature; a request that asks for greedy is not drawn again (it would
    # come out the same).
    ask = {"messages": OSLO, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40}
    for temperature, redraws in ((0.7, 2), (openai.omit, 2), (0, 0)):
        if stream:
            calls, finish = _reply(client, stream, temperature=temperature, **ask)
        else:  # one request: its calls, and how often it was drawn
            whole = client.chat.completions.create(model=MODEL, temperature=temperature, **ask)
            calls, finish = _calls(whole.choices[0])
            assert whole.model_extra["pellucid"]["timings"][0]["redraws"] == redraws
            assert whole.usage.completion_tokens <= 40  # the last draw's tokens
        assert len(calls) == 1 and calls[0][1]["city"] == "" and finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_required_with_an_array_of_objects_and_a_dotted_name(
    client: openai.OpenAI, stream: bool
) -> None:
    calls, finish = _reply(
        client,
        stream,
        messages=[{"role": "user", "content": "Order 2 kg of apples and 3 lemons."}],
        tools=[ORDER, WEATHER],
        tool_choice={"type": "function", "function": {"name": "shop.place_order"}},
        max_tokens=300,  # the schema is the point here, not the end of the context
    )
    assert calls and finish == "tool_calls"
    for name, args in calls:
        assert name == "shop.place_order"
        jsonschema.validate(args, ORDER["function"]["parameters"])
        assert args["items"] and all(isinstance(i, dict) for i in args["items"])


def test_tool_results_go_back_to_the_model(client: openai.OpenAI) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    # Bounded: an integer's digits are otherwise unlimited, and greedy 135M output repeats them.
    population = {"type": "integer", "minimum": 0, "maximum": 10**9}
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "population": population},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=100,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "bad",
    [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {
            "tools": [
                {"type": "function", "function": {"name": "x", "parameters": {"type": "nonsense"}}}
            ],
            "tool_choice": "required",
        },
        {"response_format": {"type": "json_schema"}},
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},  # a space
    ],
)
def test_bad_tool_requests_are_400(client: openai.OpenAI, bad: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **bad)
    assert e.value.body["message"]


def test_smolagents_completes_a_tool_task(server: Running) -> None:
    smolagents = pytest.importorskip("smolagents")
    asked: list[str] = []

    @smolagents.tool
    def capital_of(country: str) -> str:
        """Look up the capital city of a country.

        Args:
            country: The country's name, e.g. "Spain".
        """
        asked.append(country)
        return {"France": "Paris"}.get(country, "unknown")

    model = smolagents.OpenAIModel(
        model_id=MODEL, api_base=server.url + "/v1", api_key=KEY, temperature=0, max_tokens=120
    )
    agent = smolagents.ToolCallingAgent(
        tools=[capital_of], model=model, max_steps=4, verbosity_level=0
    )
    answer = agent.run("What is the capital of France?")
    assert "France" in asked  # smolagents parsed our tool_calls and ran the tool
    steps = [s for s in agent.memory.steps if getattr(s, "tool_calls", None)]
    assert all(c.name in ("capital_of", "final_answer") for s in steps for c in s.tool_calls)
    # The tool's result went back to the server as a message, and the server answered it: the
    # step after the first call was asked with "Paris" in its input and got a reply. What the
    # 135M model then writes (final_answer, another call, or a call spelled out in prose that
    # smolagents' max-steps answer returns) is the model's choice, not the server's.
    later = [s for s in agent.memory.steps[1:] if getattr(s, "model_input_messages", None)]
    assert any("Paris" in str(s.model_input_messages) for s in later)
    assert all(s.model_output_message is not None for s in later)
    assert str(answer).strip()
