"""Tools through the server: OpenAI `tools`, `tool_choice`, streamed `tool_calls`, and
`response_format`, driven by the official `openai` client and by smolagents as a real agent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from helpers import KEY, MODEL, Running, serving

from pellucid import LLM
from pellucid.server import create_app

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
def server(smollm2: LLM) -> Iterator[Running]:
    with serving(create_app(smollm2, api_key=KEY, model_name=MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


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
    # The 135M model keeps calling the tool rather than final_answer, so smolagents ends with
    # its max-steps answer, written from the observations it sent back to the server.
    assert "Paris" in str(answer)
