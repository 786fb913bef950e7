"""Generation through the public API: sampling options, streaming, stop conditions, bad input."""

from __future__ import annotations

import pytest

from pellucid import SamplingParams
from pellucid.errors import PromptError


def test_capital_of_france(smollm2):
    out = smollm2.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].text


def test_result_fields_and_timings(smollm2):
    out = smollm2.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text == smollm2.tokenizer.decode(out.token_ids)
    t = out.timings
    assert t.prompt_tokens == len(out.prompt_token_ids) and t.prefill_s > 0
    assert t.decode_tokens == 4 and t.decode_tokens_per_s > 0  # the first token came from pre-fill


def test_batch_of_prompts_keeps_order(smollm2):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=6)
    together = smollm2.generate(prompts, params)
    alone = [smollm2.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_each_prompt_can_have_its_own_params(smollm2):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=7),
    ]
    together = smollm2.generate(prompts, params)
    alone = [smollm2.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    assert [len(o.token_ids) for o in together] == [3, 7]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    with pytest.raises(ValueError, match="one per prompt"):
        smollm2.generate(prompts, params[:1])


def test_seeded_sampling_repeats_and_seeds_differ(smollm2):
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
        return smollm2.generate("My favourite food is", params)[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stream_deltas_add_up_to_the_text(smollm2):
    params = SamplingParams(temperature=0, max_tokens=20)
    outs = list(smollm2.stream("Write a list of three fruits:", params))
    assert "".join(o.delta for o in outs) == outs[-1].text
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_stop_string_never_appears(smollm2):
    free = smollm2.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12))[0]
    assert " 7," in free.text  # the model counts on
    params = SamplingParams(temperature=0, max_tokens=12, stop=[" 7,"])
    outs = list(smollm2.stream("1, 2, 3, 4, 5,", params))
    text = "".join(o.delta for o in outs)
    assert " 7," not in text and text == outs[-1].text
    assert free.text.startswith(text) and outs[-1].finish_reason == "stop"


def test_stop_token_ids_and_eos(smollm2):
    eos_reply = smollm2.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0)
    )
    assert eos_reply.finish_reason == "stop"  # the instruct model ends its turn by itself
    assert "<|im_end|>" not in eos_reply.text
    free = smollm2.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=4))[0]
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[free.token_ids[1]])
    cut = smollm2.generate("1, 2, 3,", params)[0]
    assert cut.token_ids == free.token_ids[:2] and cut.finish_reason == "stop"


def test_emoji_and_cjk_stream_as_whole_characters(smollm2):
    # Force byte-level tokens: feed a prompt the model copies, and check every delta is valid text.
    prompt = "Repeat exactly: 🎉🇯🇵 日本語のテキスト 👩‍👩‍👧\nRepeat exactly:"
    outs = list(smollm2.stream(prompt, SamplingParams(temperature=0, max_tokens=24)))
    assert all("\ufffd" not in o.delta for o in outs)
    assert "".join(o.delta for o in outs) == outs[-1].text


def test_empty_prompt_is_refused(smollm2):
    with pytest.raises(PromptError, match="empty"):
        smollm2.generate("", SamplingParams(max_tokens=1))


def test_prompt_longer_than_the_context_is_refused(smollm2):
    too_long = [28] * smollm2.engine.max_model_len
    with pytest.raises(PromptError, match=r"context holds \d+"):
        smollm2.generate(too_long, SamplingParams(max_tokens=1))


def test_generation_stops_at_the_context_limit(smollm2_short):
    prompt = smollm2_short.encode("Count: 1, 2, 3,")
    out = smollm2_short.generate(prompt, SamplingParams(temperature=0, max_tokens=500))[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == smollm2_short.engine.max_model_len


def test_logprobs_are_those_of_the_raw_distribution(smollm2):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=5)
    out = smollm2.generate("The sky is", params)[0]
    ids = out.prompt_token_ids + out.token_ids
    full = smollm2.logits(ids[:-1]).log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        row = full[len(out.prompt_token_ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
