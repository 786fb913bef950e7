"""Grammar-constrained decoding and the tool-call format: masks, grammars, parsing, prompts."""

from __future__ import annotations

import json
import re

import pytest
import torch
from llama_cpp_source import source_dir

from pellucid import LLM, SamplingParams
from pellucid.engine.grammar import GrammarCompiler, unpack_bitmask
from pellucid.engine.sampler import SamplerState, sample
from pellucid.engine.sequence import Sequence
from pellucid.structured import (
    ToolCallStream,
    parse_tool_calls,
    prepare_chat,
    response_format_grammar,
    tool_call_grammar,
)
from pellucid.structured.chat_request import parallel_calls_by_default
from pellucid.structured.grammars import MAX_PARALLEL_CALLS
from pellucid.structured.tool_prompt import messages_with_tools
from pellucid.tokenizer.chat_template import renders_parallel_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def test_unpack_bitmask_matches_the_bits() -> None:
    words = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    allowed = unpack_bitmask(words, 100)
    for row in range(3):
        for token in range(100):
            bit = (int(words[row, token // 32]) >> (token % 32)) & 1
            assert allowed[row, token].item() == bool(bit)
    assert not unpack_bitmask(words, 140)[:, 128:].any()  # past the tokenizer: never allowed


def _accepts(grammars: GrammarCompiler, grammar: str, text: str) -> bool:
    matcher = grammars.matcher(grammar)
    ids = grammars.tokenizer.encode(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_required_grammar_accepts_exactly_valid_calls(smollm2: LLM) -> None:
    g = GrammarCompiler(smollm2.tokenizer)
    grammar = tool_call_grammar([WEATHER, CALC], "required", parallel=False)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert _accepts(g, grammar, good)
    assert not _accepts(g, grammar, good.replace('"c"', '"kelvin"'))  # not in the enum
    assert not _accepts(g, grammar, good.replace("get_weather", "get_wether"))  # no such tool
    assert not _accepts(g, grammar, "It is sunny.")  # a call is required
    assert not _accepts(g, grammar, good + "\n" + good)  # one call only
    parallel = tool_call_grammar([WEATHER], "required", parallel=True)
    assert _accepts(g, parallel, "\n".join([good] * MAX_PARALLEL_CALLS))
    assert not _accepts(g, parallel, "\n".join([good] * (MAX_PARALLEL_CALLS + 1)))


def test_auto_grammar_allows_text_and_constrains_a_started_call(smollm2: LLM) -> None:
    g = GrammarCompiler(smollm2.tokenizer)
    grammar = tool_call_grammar([CALC], "auto")
    assert _accepts(g, grammar, "No tool needed: 4.")
    matcher = g.matcher(grammar)
    assert matcher.consume_tokens(g.tokenizer.encode("Let me compute. <tool_call>"))
    allowed = g.token_masks([matcher], smollm2.model.cfg.vocab_size)[0]
    assert [smollm2.tokenizer.id_to_piece(i) for i in allowed.nonzero()[:, 0]] == ["\n"]


def test_named_choice_and_errors() -> None:
    named = {"type": "function", "function": {"name": "calculator"}}
    assert "get_weather" not in tool_call_grammar([WEATHER, CALC], named)
    assert tool_call_grammar([WEATHER], "none") is None
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="no tools"):
        tool_call_grammar([], "required")
    with pytest.raises(ValueError, match="response_format type"):
        response_format_grammar({"type": "yaml"})


def test_generation_follows_the_grammar(smollm2: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=20, grammar="start: /[0-9]{3}-[a-z]{2}/"
    )
    for out in smollm2.generate(["My code is", "Write anything:"], params):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.text), out.text
        assert out.finish_reason == "stop" and out.forced is not None
    with pytest.raises(ValueError, match="does not compile"):
        smollm2.generate("x", SamplingParams(grammar="start: (("))


def test_chat_with_required_tools_returns_valid_calls(smollm2: LLM) -> None:
    import jsonschema

    out = smollm2.chat(
        [{"role": "user", "content": "Weather in Oslo?"}],
        SamplingParams(temperature=0, max_tokens=60),
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert len(out.tool_calls) == 1 and out.tool_calls[0].name == "get_weather"
    jsonschema.validate(out.tool_calls[0].args, WEATHER["function"]["parameters"])
    assert sum(out.forced) > 10  # the tags and the name's JSON are forced, not chosen


def _loop_on(smollm2: LLM, piece: str, params: SamplingParams) -> list[int]:
    """Greedy decoding where the model always most wants `piece`: a loop, as small models do."""
    g = GrammarCompiler(smollm2.tokenizer)
    state = SamplerState(params, [1], smollm2.model.cfg.vocab_size)
    state.matcher, state.grammars = g.matcher(params.grammar), g
    looping = smollm2.tokenizer.encode(piece)
    assert len(looping) == 1
    logits = torch.zeros(1, smollm2.model.cfg.vocab_size)
    logits[0, looping[0]] = 10.0
    out = []
    while len(out) < params.max_tokens:
        token = int(sample(logits, [state]).token_ids[0])
        if token in smollm2.tokenizer.eos_ids:
            break
        out.append(token)
        state.update(token)
    return out


def test_close_margin_ends_a_looping_call_valid(smollm2: LLM) -> None:
    grammar = tool_call_grammar([WEATHER], "required", parallel=False)
    looping = SamplingParams(temperature=0, max_tokens=60, grammar=grammar)
    text = smollm2.tokenizer.decode(_loop_on(smollm2, " Oslo", looping))
    assert not parse_tool_calls(text).tool_calls  # without a margin: cut off inside the city
    closing = SamplingParams(temperature=0, max_tokens=60, grammar=grammar, grammar_close_margin=16)
    ids = _loop_on(smollm2, " Oslo", closing)
    reply = parse_tool_calls(smollm2.tokenizer.decode(ids))
    assert len(ids) < 60 and not reply.errors
    assert reply.tool_calls[0].args["city"].startswith(" Oslo Oslo")
    # "}}" inside a string is text, not a close: quotes must win while a string is open
    reply = parse_tool_calls(smollm2.tokenizer.decode(_loop_on(smollm2, "}}", closing)))
    assert not reply.errors and reply.tool_calls[0].args["city"].startswith("}}}}")
    assert (
        prepare_chat(
            smollm2.tokenizer,
            [{"role": "user", "content": "hi"}],
            tools=[WEATHER],
            tool_choice="required",
        ).close_margin
        > 0
    )
    assert (
        prepare_chat(
            smollm2.tokenizer,
            [{"role": "user", "content": "hi"}],
            tools=[WEATHER],
            tool_choice="auto",
        ).close_margin
        == 0
    )  # free text must not be cut


def _call_reply(
    smollm2: LLM, wants: str | None = None, text: str = "", **overrides: object
) -> Sequence:
    """A greedy reply under the required tool-call grammar, as the engine runs it (its
    Sequence): the tokens of `text` appended as they are, then, where the model always most
    `wants` one piece, sampled until it ends (at most 300 tokens). `overrides`: SamplingParams."""
    tok = smollm2.tokenizer
    chat = prepare_chat(tok, [{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    fields = prepare_chat(
        tok, [{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required"
    ).sampling_fields()
    params = SamplingParams(**{"temperature": 0, "max_tokens": 300, **fields, **overrides})
    vocab = smollm2.model.cfg.vocab_size
    seq = Sequence(smollm2.encode_chat(chat.prompt), params, tok, vocab, 8192)
    seq.sampler_state.matcher = smollm2.engine.grammars.matcher(params.grammar)
    seq.sampler_state.grammars = smollm2.engine.grammars
    for t in tok.encode(text, parse_special=True):
        seq.append(t)
    if wants is not None:
        (wanted,) = tok.encode(wants)
        logits = torch.zeros(1, vocab)
        logits[0, wanted] = 10.0
        while not seq.is_finished:
            seq.append(int(sample(logits, [seq.sampler_state]).token_ids[0]))
    return seq


def test_a_string_does_not_open_with_a_closer(smollm2: LLM) -> None:
    # Small models write `"city": "}}` meaning an empty city and the end of the call, then
    # ramble inside the string. Wanting `"}` (one token) everywhere, the model gets "" instead.
    seq = _call_reply(smollm2, wants='"}')
    calls = parse_tool_calls(seq.text).tool_calls
    assert calls and calls[0].args["city"] == "" and seq.finish_reason == "stop"
    # A string just opened, with `}}` wanted first: the string closes, empty.
    seq = _call_reply(
        smollm2, wants="}}", text='<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    )
    assert parse_tool_calls(seq.text).tool_calls[0].args["city"] == ""


def test_a_reply_that_lost_its_way_closes_at_once(smollm2: LLM) -> None:
    start = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo'
    # The closing tag written inside the string: the model thinks the call is over.
    lost = _call_reply(smollm2, text=start + "}}</tool_call>")
    assert lost.sampler_state.close_now
    assert not _call_reply(smollm2, text=start).sampler_state.close_now
    # A stretch repeated: with " Oslo" wanted for ever, the margin closes the call long before
    # max_tokens, and since it took the model's choice away the call is dropped ("length")...
    seq = _call_reply(smollm2, wants=" Oslo", text=start, require_block=False)
    assert seq.sampler_state.close_now and seq.sampler_state.forced_shut
    assert len(seq.output_ids) < 100 and seq.finish_reason == "length" and seq.text == ""
    # ... unless the reply must hold a call and cannot be drawn again (greedy): then it keeps
    # the call it has, still "length".
    seq = _call_reply(smollm2, wants=" Oslo", text=start)
    (call,) = parse_tool_calls(seq.text).tool_calls
    assert call.args["city"].startswith("Oslo Oslo") and seq.finish_reason == "length"


@pytest.mark.parametrize("per_block", [False, True])
def test_call_penalties_count_within_one_call(smollm2: LLM, per_block: bool) -> None:
    # The calls' frequency penalty is there against loops inside a call. Counted over the whole
    # reply it would push a second call off an exact repeat of the first (which ends the reply)
    # onto a near one ("city": "" after "Oslo"), so it starts over when a call closes.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    seq = _call_reply(smollm2, text=call, frequency_penalty=0.5, penalties_per_block=per_block)
    counts = seq.sampler_state.counts
    assert counts.sum() == len(seq.output_ids)  # still inside the call: every token counts
    for t in smollm2.tokenizer.encode("\n</tool_call>", parse_special=True):
        seq.append(t)
    assert counts.sum() == (0 if per_block else len(seq.output_ids))
    opener = smollm2.tokenizer.encode("\n<tool_call>\n{", parse_special=True)
    for t in opener:
        seq.append(t)
    assert counts.sum() == (len(opener) if per_block else len(seq.output_ids))


def test_parse_tool_calls() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    reply = parse_tool_calls(text)
    assert [(c.name, c.args) for c in reply.tool_calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert reply.content.startswith("Sure.") and "{not json}" in reply.content
    assert len(reply.errors) == 1
    assert parse_tool_calls('<tool_call>{"name": "a"').errors  # cut off


def test_tool_call_stream_holds_partial_tags() -> None:
    text = "Hi <tool_ca" + 'll>\n{"name": "a", "arguments": {}}\n</tool_call> bye <tool'
    stream, seen, calls = ToolCallStream(), [], []
    for i in range(0, len(text), 3):  # three characters at a time
        t, c = stream.feed(text[i : i + 3])
        seen.append(t)
        calls += c
    seen.append(stream.flush())
    assert "".join(seen) == "Hi  bye <tool"
    assert [c.name for c in calls] == ["a"]
    assert all("<tool_c" not in s for s in seen[:-1])


def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call() -> None:
    code = 'print("</tool_call>")'
    text = (
        "<tool_call>\n"
        + json.dumps({"name": "python", "arguments": {"code": code}})
        + '\n</tool_call> done <tool_call>{"name": "b"}</tool_call>'
    )
    reply = parse_tool_calls(text)
    assert [c.name for c in reply.tool_calls] == ["python", "b"]
    assert reply.tool_calls[0].args == {"code": code}
    assert reply.content == "done" and not reply.errors
    stream, seen, calls = ToolCallStream(), [], []
    for ch in text:  # one character at a time: every cut through the block is tried
        t, c = stream.feed(ch)
        seen.append(t)
        calls += c
    seen.append(stream.flush())
    assert [c.args for c in calls] == [{"code": code}, {}]
    assert "".join(seen) == " done "


def test_tool_turns_become_text_for_templates_without_tools() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "one"},
        {"role": "tool", "tool_call_id": "2", "content": "two"},
    ]
    out = messages_with_tools(messages, [CALC])
    assert out[0]["role"] == "system" and '"calculator"' in out[0]["content"]
    assert json.loads(out[2]["content"].split("\n")[1]) == {"name": "a", "arguments": {"x": 1}}
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>",
    }


def test_prepare_chat_none_leaves_tools_out(smollm2: LLM) -> None:
    chat = prepare_chat(
        smollm2.tokenizer, [{"role": "user", "content": "hi"}], tools=[CALC], tool_choice="none"
    )
    assert chat.grammar is None and not chat.parse_calls and "calculator" not in chat.prompt
    off = prepare_chat(
        smollm2.tokenizer,
        [{"role": "user", "content": "hi"}],
        tools=[CALC],
        tool_choice="required",
        constrained=False,
    )
    assert off.grammar is None and off.parse_calls and "calculator" in off.prompt


# llama.cpp's copies of real chat templates, and whether each writes out a turn of two calls:
# by reading them (Qwen's and Hermes' loop over the calls, Llama 3.1's raises on more than one,
# Gemma 2's knows no tools)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": True,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": True,
    "mistralai-Mistral-Nemo-Instruct-2407": True,  # asks for call ids of 9 characters
    "meta-llama-Llama-3.1-8B-Instruct": False,
    "google-gemma-2-2b-it": False,
}


def test_parallel_calls_by_default_where_the_template_writes_them(smollm2: LLM) -> None:
    folder = source_dir() / "models" / "templates"
    for name, parallel in TEMPLATES.items():
        assert renders_parallel_calls((folder / f"{name}.jinja").read_text()) == parallel, name
    # SmolLM2's template knows no tools: pellucid's own format, one call a reply unless asked
    assert not parallel_calls_by_default(smollm2.tokenizer)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    grammars = [
        prepare_chat(smollm2.tokenizer, ask, tools=[WEATHER], tool_choice="required", **kw).grammar
        for kw in ({}, {"parallel_tool_calls": False}, {"parallel_tool_calls": True})
    ]
    assert grammars[0] == grammars[1] != grammars[2]
