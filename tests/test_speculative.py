"""Speculative decoding from the sequence's own n-grams (engine/drafter.py, LLMEngine.take_drafts):
the drafter's guesses and lengths, and that drafting changes how fast tokens come, never which.
Every comparison also checks that guesses were made and taken, so none can pass with drafting
silently off; the rollback tests check that some were refused."""

import json
from dataclasses import replace

import pytest
import torch

from pellucid import LLM, SamplingParams
from pellucid.config import EngineConfig
from pellucid.engine import drafter
from pellucid.engine.drafter import MAX_DRAFT, NgramDrafter, best_draft_len, longest_match
from pellucid.engine.sampling_params import TraceOptions
from pellucid.engine.scheduler import DRAFT_ROWS
from pellucid.structured import prepare_chat
from pellucid.structured.chat_request import reply_defaults

PARAGRAPH = (
    "The committee met on Tuesday to review the budget. It approved the new library, delayed "
    "the road repairs until spring, and asked the treasurer for a report on the pension fund."
)
COPY = [
    {
        "role": "user",
        "content": f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}",
    }
]
JSON_DOC = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "city": "London"}'
JSON_EDIT = [
    {
        "role": "user",
        "content": f"Here is a JSON document:\n{JSON_DOC}\nWrite it again with city set to Paris.",
    }
]


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    """The request as a chat, or for a base model (Gemma 3 270M) as text to complete."""
    if llm.tokenizer.chat_template is None:
        return llm.tokenizer.encode(messages[-1]["content"] + "\n\nThe same, written again:\n")
    return llm.chat_prompt(messages)


def both_ways(llm: LLM, ids: list[int], params: SamplingParams):
    """(output without drafts, output with a draft wherever one exists)."""
    plain = llm.generate([ids], replace(params, speculative=False))[0]
    drafted = llm.generate([ids], replace(params, speculative=True))[0]
    assert plain.timings.draft_tokens == 0
    return plain, drafted


def test_drafter_guesses_what_followed_the_latest_earlier_occurrence():
    d = NgramDrafter()
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    # "5 6" occurred at 0 and 5; the latest is followed by 7 1 2 5 6
    assert d.propose(tokens, most=3, force=True) == [7, 1, 2]
    # the tail's own occurrence has no continuation yet: no guess from a token seen only there
    assert NgramDrafter().propose([1, 2, 3, 4], most=3, force=True) == []


def test_drafter_index_grows_with_the_sequence_and_starts_over_on_a_redraw():
    d = NgramDrafter()
    tokens = [1, 2, 3, 4]
    assert d.propose(tokens, most=2, force=True) == []
    tokens += [1, 2]
    assert d.propose(tokens, most=2, force=True) == [3, 4]
    d.forget()
    assert d.propose([9, 9, 1, 2], most=2, force=True) == []


def test_drafter_keeps_its_place_in_a_copy_across_a_changed_token():
    d = NgramDrafter()
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    tokens = source + [99, 10, 11]  # the copy has begun
    assert d.propose(tokens, most=3, force=True) == [12, 13, 14]
    d.record(taken=1, missed=True)  # 12 taken; then 50 came where the source has 13
    tokens += [12, 50]
    # the copy went on past the change: 50 is not in the source, no n-gram ends in it
    assert d.propose(tokens, most=3, force=True) == []
    tokens += [14]  # ... and it is back on the source, one token further
    assert d.propose(tokens, most=3, force=True) == [15, 16, 17]


def test_draft_length_follows_how_often_guesses_are_taken():
    lengths = [best_draft_len(chance, MAX_DRAFT) for chance in (0.0, 0.1, 0.5, 0.8, 0.95)]
    assert lengths[0] == lengths[1] == 0  # guesses mostly wrong: no draft pays
    assert 0 < lengths[2] < lengths[3] <= lengths[4] <= MAX_DRAFT
    d = NgramDrafter()
    d.record(taken=0, missed=True)
    low = d.chance
    d.record(taken=5, missed=False)
    assert d.chance > low


def test_a_draft_in_a_wide_step_or_a_long_context_needs_better_odds(monkeypatch):
    """In a batch of 6 rows, a draft slows 5 other sequences too. At 8k tokens of context, a
    guess's row reads as many keys as its sequence's, converted once for both (GUESS_ATTEND of
    a row's reading): drafts are shorter, and guesses at poor odds stop."""
    assert best_draft_len(0.6, 4, rows=6) < best_draft_len(0.6, 4, rows=1)
    assert best_draft_len(0.3, 4, rows=6) == 0
    assert best_draft_len(0.3, MAX_DRAFT, context=100) == 1
    assert best_draft_len(0.3, MAX_DRAFT, context=8000) == 0
    short, long = (best_draft_len(0.7, MAX_DRAFT, context=c) for c in (100, 8000))
    assert 0 < long < short
    assert best_draft_len(0.99, MAX_DRAFT, context=8000) > 0
    monkeypatch.setattr(drafter, "GUESS_ATTEND", 1.0)  # were each guess to read on its own
    assert best_draft_len(0.7, MAX_DRAFT, context=8000) == 0


def test_unforced_drafter_stops_guessing_when_guesses_miss_and_looks_again_later():
    d = NgramDrafter()
    tokens = [1, 2, 3, 4, 1, 2]
    for _ in range(20):
        d.record(taken=0, missed=True)
    tries = [bool(d.propose(tokens, most=4)) for _ in range(40)]
    assert not any(tries[:15])  # off while its record is bad ...
    assert any(tries)  # ... but it tries again now and then


def test_greedy_output_is_the_same_with_drafts_on_the_tiny_model(tiny):
    """A random tiny model loops, so its own n-grams predict it: many guesses are checked."""
    ids = tiny.tokenizer.encode("abcabcabc hello hello")
    plain, drafted = both_ways(tiny, ids, SamplingParams(temperature=0, max_tokens=64))
    assert drafted.token_ids == plain.token_ids
    assert drafted.timings.accepted_tokens > 0
    assert drafted.timings.decode_tokens == plain.timings.decode_tokens


def test_no_guesses_beside_a_pre_fill_so_its_chunks_stay_where_they_were(tiny_path):
    """Guesses would take rows from a pre-fill's chunk and move its bounds, and with them how
    its prompt is rounded: a step that pre-fills carries none, and guessing resumes after."""
    llm = LLM(tiny_path, dtype="float32", engine=EngineConfig(max_num_batched_tokens=16))
    engine, forced = llm.engine, SamplingParams(temperature=0, max_tokens=40, speculative=True)
    looping = engine.add_request(llm.tokenizer.encode("abcabcabc hello hello"), forced)
    while not looping.output_ids:  # until its prompt is in and it decodes
        engine.step()
    engine.add_request(llm.tokenizer.encode("a prompt of more than sixteen bytes"), forced)
    batches = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: batches.append(schedule()) or batches[-1]
    while engine.has_unfinished():
        engine.step()
    drafted_beside_pre_fill = drafted_after = 0
    for batch in batches:
        drafts = sum(len(it.drafts) for it in batch.items)
        if any(it.n_tokens - len(it.drafts) > 1 for it in batch.items):
            drafted_beside_pre_fill += drafts
        else:
            drafted_after += drafts
    assert sum(any(it.n_tokens > 1 and not it.drafts for it in b.items) for b in batches) >= 2
    assert drafted_beside_pre_fill == 0
    assert drafted_after > 0  # the rule held back guesses that were there to make


@pytest.mark.parametrize("messages", [COPY, JSON_EDIT], ids=["paragraph", "json"])
def test_greedy_output_is_the_same_with_drafts(any_llm, messages):
    ids = chat_ids(any_llm, messages)
    plain, drafted = both_ways(any_llm, ids, SamplingParams(temperature=0, max_tokens=80))
    assert drafted.text == plain.text
    assert drafted.finish_reason == plain.finish_reason
    t = drafted.timings
    assert t.accepted_tokens >= 10, t  # a copy: most guesses are taken


def test_greedy_output_is_the_same_with_drafts_on_the_default_path(smollm2_path):
    """The default path (int4, its decode step compiled ahead): a step with guesses runs the
    same graph as one without (engine/aot_decode.py), so the reply and its logprobs are the same
    to the bit. Without the prefix cache, both pre-fill the prompt alike."""
    llm = LLM(smollm2_path, engine=EngineConfig(enable_prefix_caching=False))
    decode = llm.engine.model_runner.compiled_decode
    if decode is None or decode.ahead.get(1) is None:
        pytest.skip("no few-row package built for SmolLM2 here (make run builds it)")
    before, plain_steps = decode.steps, 0
    for messages in (COPY, JSON_EDIT):
        params = SamplingParams(temperature=0, max_tokens=80, logprobs=0)
        plain, drafted = both_ways(llm, chat_ids(llm, messages), params)
        assert drafted.token_ids == plain.token_ids
        assert [t.logprob for t in drafted.logprobs] == [t.logprob for t in plain.logprobs]
        assert drafted.timings.accepted_tokens >= 10, drafted.timings
        plain_steps += len(plain.token_ids) - 1  # a decode step a token after the first
    # every plain step ran on the package, and the drafted ones too (at least one each)
    assert decode.steps - before > plain_steps, (decode.steps - before, plain_steps)


def test_default_drafting_pays_on_a_copy_and_leaves_the_text_alone(smollm2):
    ids = chat_ids(smollm2, COPY)
    params = SamplingParams(temperature=0, max_tokens=80)
    plain = smollm2.generate([ids], replace(params, speculative=False))[0]
    auto = smollm2.generate([ids], params)[0]
    assert auto.text == plain.text
    assert auto.timings.accepted_tokens > auto.timings.decode_tokens // 3


def test_an_engine_with_speculation_off_never_drafts_even_when_asked(smollm2):
    """EngineConfig(speculative=False), what `pellucid serve --no-speculative` sets: a request
    that forces drafts gets none, and the same text as with them."""
    ids = chat_ids(smollm2, COPY)
    params = SamplingParams(temperature=0, max_tokens=40, speculative=True)
    off = LLM("smollm2-135m", dtype="float32", engine=EngineConfig(speculative=False))
    drafted, plain = smollm2.generate([ids], params)[0], off.generate([ids], params)[0]
    assert drafted.timings.draft_tokens > 0 and plain.timings.draft_tokens == 0
    assert plain.text == drafted.text


def test_seeded_sampling_draws_the_same_tokens_with_drafts(tiny):
    """Each token is drawn exactly as without drafts, a guess taken only when it is that token:
    the rejection rule for a one-token guess. So the distribution of replies is unchanged, and
    with a seed, each reply is: checked over many seeds at temperature 1."""
    ids = tiny.tokenizer.encode("abcabcabc hello hello")
    taken = 0
    for seed in range(30):
        params = SamplingParams(temperature=1.0, top_k=4, max_tokens=24, seed=seed)
        plain, drafted = both_ways(tiny, ids, params)
        assert drafted.token_ids == plain.token_ids, seed
        taken += drafted.timings.accepted_tokens
    assert taken > 30


def test_sampled_replies_keep_their_distribution_with_drafts(tiny):
    """Unseeded: the first tokens' frequencies with and without drafts agree (chi-square)."""
    ids = tiny.tokenizer.encode("abcabcabc hello hello")
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=4)
    n = 300
    runs = {}
    for speculative in (False, True):
        each = replace(params, speculative=speculative)
        # in fours, so that each step has rows to spare for drafts
        outs = [o for _ in range(n // 4) for o in tiny.generate([ids] * 4, [each] * 4)]
        runs[speculative] = [tuple(o.token_ids[1:3]) for o in outs]  # [0] comes from pre-fill
    assert sum(o.timings.accepted_tokens for o in outs) > n // 10
    keys = sorted(set(runs[False]) | set(runs[True]))
    counts = {s: [runs[s].count(k) for k in keys] for s in runs}
    # Pool rare outcomes, then a chi-square test of homogeneity at 1% (df = cells - 1)
    common = [i for i, k in enumerate(keys) if counts[False][i] + counts[True][i] >= 10]
    a = [counts[False][i] for i in common] + [n - sum(counts[False][i] for i in common)]
    b = [counts[True][i] for i in common] + [n - sum(counts[True][i] for i in common)]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)
    critical = {1: 6.63, 2: 9.21, 3: 11.34, 4: 13.28}
    df = len(a) - 1
    assert 1 <= df <= 4, (keys, counts)
    assert chi2 < critical[df], (chi2, a, b)


def test_stop_string_inside_the_copied_text_ends_the_reply_as_without_drafts(smollm2):
    ids = chat_ids(smollm2, COPY)
    params = SamplingParams(temperature=0, max_tokens=80, stop=["road repairs"])
    plain, drafted = both_ways(smollm2, ids, params)
    assert plain.finish_reason == drafted.finish_reason == "stop"
    assert drafted.text == plain.text and "road" not in drafted.text
    assert drafted.timings.accepted_tokens > 0


def test_max_tokens_is_never_passed_with_drafts(smollm2):
    ids = chat_ids(smollm2, COPY)
    for n in (1, 2, 5, 13):
        plain, drafted = both_ways(smollm2, ids, SamplingParams(temperature=0, max_tokens=n))
        assert drafted.token_ids == plain.token_ids and len(drafted.token_ids) == n


def test_grammar_masks_apply_to_each_drafted_token(smollm2):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
        "required": ["name", "born"],
    }
    grammar = "start: %json " + json.dumps(schema)
    ids = chat_ids(smollm2, JSON_EDIT)
    params = SamplingParams(temperature=0, max_tokens=60, grammar=grammar)
    plain, drafted = both_ways(smollm2, ids, params)
    assert drafted.text == plain.text
    assert drafted.forced == plain.forced  # the grammar's choices, token by token
    assert drafted.timings.accepted_tokens > 0


def test_logprobs_come_for_every_token_drafted_or_not(smollm2):
    ids = chat_ids(smollm2, COPY)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=2)
    plain, drafted = both_ways(smollm2, ids, params)
    assert drafted.token_ids == plain.token_ids
    assert [lp.token_id for lp in drafted.logprobs] == drafted.token_ids
    for a, b in zip(plain.logprobs, drafted.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert drafted.timings.accepted_tokens > 0


def test_blocks_written_with_drafts_serve_a_later_prompt_from_the_prefix_cache(smollm2):
    """The K/V of refused guesses is overwritten before its block is shared: a prompt that
    continues a drafted reply, served from those cached blocks, gets the same next tokens as
    from a fresh pre-fill."""
    ids = chat_ids(smollm2, COPY)
    first = smollm2.generate([ids], SamplingParams(temperature=0, max_tokens=64, speculative=True))
    assert first[0].timings.draft_tokens > first[0].timings.accepted_tokens > 0
    follow = ids + first[0].token_ids[:-1]
    params = SamplingParams(temperature=0, max_tokens=8, speculative=False, logprobs=1)
    hits = smollm2.engine.stats().prefix_cache_hits
    cached = smollm2.generate([follow], params)[0]
    block_size = smollm2.engine.block_manager.block_size
    hit_blocks = (smollm2.engine.stats().prefix_cache_hits - hits) // block_size
    assert hit_blocks == (len(follow) - 1) // block_size  # all but the last token, cached
    fresh = LLM("smollm2-135m", dtype="float32", engine=EngineConfig(enable_prefix_caching=False))
    again = fresh.generate([follow], params)[0]
    assert cached.token_ids == again.token_ids
    for a, b in zip(cached.logprobs, again.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_server_drafts_on_request_and_counts_them_in_metrics(smollm2):
    """Through the API, streaming and not: the same reply with drafts forced on and off, the
    drafts in `pellucid.timings`, and /metrics counting them and their acceptance rate."""
    import httpx
    import openai
    from helpers import KEY, MODEL, serving

    from pellucid.server import create_app

    def metric(url: str, name: str) -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith(f"pellucid:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    with serving(create_app(smollm2, api_key=KEY, model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        ask = {"model": MODEL, "messages": COPY, "max_tokens": 60, "temperature": 0}
        replies, timings = {}, {}
        for speculative in (False, True):
            r = client.chat.completions.create(**ask, extra_body={"speculative": speculative})
            replies[speculative] = r.choices[0].message.content
            timings[speculative] = r.model_extra["pellucid"]["timings"][0]
        assert replies[True] == replies[False]
        assert timings[False]["draft_tokens"] == 0
        assert timings[True]["accepted_tokens"] > 10
        stream = client.chat.completions.create(
            **ask, stream=True, extra_body={"speculative": True}
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == replies[True]
        drafted = metric(server.url, "spec_decode_num_draft_tokens_total")
        accepted = metric(server.url, "spec_decode_num_accepted_tokens_total")
        assert drafted >= 2 * timings[True]["draft_tokens"]  # the whole and the streamed
        assert accepted >= 2 * timings[True]["accepted_tokens"]
        rate = metric(server.url, "spec_decode_draft_acceptance_rate")
        assert rate == pytest.approx(accepted / drafted)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**ask, extra_body={"speculative": "sometimes"})


def test_trace_shows_each_pass_guesses_and_the_tokens_they_gained(smollm2):
    """A traced copy: one step per token still, the guesses on the step whose pass checked
    them, the tokens they gained marked with it, and the attention rows of every position the
    same as without drafts (rows of refused guesses dropped)."""
    options = TraceOptions(attention_layers=[3], attention_heads=[0, 5], logit_lens=True)
    params = SamplingParams(temperature=0, max_tokens=40, trace=options)
    ids = chat_ids(smollm2, COPY)
    traces = {}
    for speculative in (False, True):
        seq = smollm2.engine.add_request(ids, replace(params, speculative=speculative))
        while smollm2.engine.has_unfinished():
            smollm2.engine.step()
        traces[speculative] = (seq, seq.trace.trace)
    seq, t = traces[True]
    assert [s.token.id for s in t.steps] == seq.output_ids == traces[False][0].output_ids
    gained = [s for s in t.steps if s.drafted_in is not None]
    assert len(gained) == sum(s.draft_taken for s in t.steps) == seq.timings.accepted_tokens > 5
    assert sum(len(s.draft) for s in t.steps) == seq.timings.draft_tokens
    for s in gained:
        assert s.seconds == 0 and t.steps[s.drafted_in].drafted_in is None
        assert t.steps[s.drafted_in].draft_taken > 0
    assert [s.context_tokens for s in t.steps] == list(range(len(ids), len(ids) + len(t.steps)))
    plain = traces[False][1].attention_for(3)
    drafted = t.attention_for(3)
    assert len(drafted.steps) == len(plain.steps) == len(t.steps) - 1
    for a, b in zip(drafted.steps, plain.steps):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    json.dumps(t.to_dict())


def test_explain_shows_the_drafts_of_a_copy(smollm2):
    from rich.console import Console

    from pellucid.trace.explain import explain
    from pellucid.trace.terminal import render

    params = SamplingParams(temperature=0, max_tokens=40, speculative=True)
    ex = explain(smollm2, COPY[0]["content"], params, chat=True)
    console = Console(record=True, width=200)
    render(ex, console)
    text = console.export_text()
    taken = sum(s.draft_taken for s in ex.trace.steps)
    assert taken > 0
    assert f"{taken} of {sum(len(s.draft) for s in ex.trace.steps)} guesses" in text
    assert "forward passes" in text and "guesses checked in its pass" in text


def test_no_room_means_no_guess_even_when_forced():
    d = NgramDrafter()
    tokens = [1, 2, 3, 4, 1, 2]
    assert d.propose(tokens, most=0, force=True) == []
    assert d.propose(tokens, most=-3, force=True) == []
    assert d.propose(tokens, most=1, force=True) == [3]


def test_a_repeated_call_is_guessed_from_its_start_not_from_the_closing_tag():
    """The tokens of `<tool_call>` and `</tool_call>` end alike: after a new opening tag, the
    latest n-gram match is the last closing tag, which was followed by the tag just written.
    The longest earlier run the reply's tail repeats is the earlier call's own opening."""
    open_tag, close_tag, nl, body = [1, 2, 3, 4, 5], [7, 2, 3, 4, 5], 6, [10, 11, 12]
    prompt = [100, 101]
    tokens = prompt + open_tag + [nl] + body + [nl] + close_tag + [nl] + open_tag + [nl]
    assert NgramDrafter().propose(tokens, most=3, force=True) == [1, 2, 3]  # the tag again
    assert longest_match(tokens, len(prompt)) == len(prompt) + len(open_tag) + 1
    assert NgramDrafter().propose(tokens, most=3, repeat_from=len(prompt)) == body


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Rome", "Dakar"]


def test_a_batch_too_wide_for_drafts_still_checks_a_repeated_call_in_one_step(smollm2_path):
    """Parallel calls allowed, SmolLM2 writes its call a second time (the repeat ends the
    reply and is dropped). In a batch wider than DRAFT_ROWS nothing is guessed but the rest of
    such a repeat, whole, in one step: the replies are those decoded without any guess. On the
    default path, as the server runs it."""
    assert len(CITIES) > DRAFT_ROWS
    smollm2 = LLM(smollm2_path)
    requests = []
    for i, city in enumerate(CITIES):
        chat = prepare_chat(
            smollm2.tokenizer,
            [{"role": "user", "content": f"What is the weather in {city}?"}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=True,
        )
        fields = reply_defaults(smollm2.sampling_defaults, chat.sampling_defaults)
        # the first request, traced (tokens and steps: the compiled path), shows its guesses
        params = SamplingParams(max_tokens=200, trace=i == 0, **fields, **chat.sampling_fields())
        requests.append((smollm2.encode_chat(chat.prompt), params))
    runs = {}
    for speculative in (False, None):  # None: the engine's choice
        engine = smollm2.engine
        seqs = [engine.add_request(ids, replace(p, speculative=speculative)) for ids, p in requests]
        while engine.has_unfinished():
            engine.step()
        runs[speculative] = seqs
    assert [s.text for s in runs[None]] == [s.text for s in runs[False]]
    first = runs[False][0]
    shown = len(smollm2.tokenizer.encode(first.text))
    assert first.text.count("<tool_call>") == 1 and len(first.output_ids) > 1.5 * shown  # twice
    steps = runs[None][0].trace.trace.steps
    assert max(len(s.draft) for s in steps) > DRAFT_ROWS  # past what a narrow step takes
    assert max(s.draft_taken for s in steps) > MAX_DRAFT  # the repeat, checked in one pass
