"""Traces recorded by the engine: what they hold, and that their numbers are the model's own.

Attention weights are checked against softmax(QKᵀ·scale) recomputed from Q and K taken with
forward hooks on a plain full forward; the logit lens at the last layer against `llm.logits`.
"""

from __future__ import annotations

import json

import pytest
import torch

from pellucid.engine.sampling_params import SamplingParams, TraceOptions
from pellucid.models.rope import apply_rope, rope_cos_sin

PROMPT = "The bank is near the river"


def run(llm, prompts: list[str], params: list[SamplingParams]):
    seqs = [llm.engine.add_request(llm.encode(p), sp) for p, sp in zip(prompts, params)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return seqs


@pytest.fixture(scope="module")
def traced(smollm2):
    options = TraceOptions(attention_layers=[0, 7], attention_heads=[0, 4], logit_lens=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, trace=options)
    (seq,) = run(smollm2, [PROMPT], [params])
    return seq


def test_trace_holds_every_stage(traced, smollm2):
    t = traced.trace.trace
    assert [tok.piece for tok in t.tokenization.tokens] == [
        "The",
        " bank",
        " is",
        " near",
        " the",
        " river",
    ]
    assert t.prefill.prompt_tokens == 6 and len(t.prefill.chunks) == 1
    assert t.prefill.chunks[0].tokens == 6 and t.prefill.seconds > 0
    assert [s.index for s in t.steps] == [0, 1, 2, 3]
    assert [s.token.id for s in t.steps] == traced.output_ids
    assert [s.context_tokens for s in t.steps] == [6, 7, 8, 9]
    assert all(s.seconds > 0 and s.bytes_moved > t.model.weight_bytes for s in t.steps)
    assert t.kv.bytes_per_token == smollm2.model.cfg.kv_bytes_per_token(4)
    assert [st.name for st in t.steps[0].stages] == ["raw", "penalties", "greedy"]
    assert t.steps[0].stages[-1].top[0].prob == 1.0 and t.steps[0].token.prob == 1.0
    assert len(t.steps[0].lens) == smollm2.model.cfg.n_layers
    assert t.finish_reason == "length" and t.output_text == traced.text
    json.dumps(t.to_dict())  # plain data all the way down


def q_and_k_outputs(attn, model, ids: list[int]) -> dict:
    """The queries and keys of one attention layer (its qkv_proj's output, cut into Q, K and V)
    in a plain full forward (no cache)."""
    got = {}
    hook = attn.qkv_proj.register_forward_hook(
        lambda m, i, o: got.update(zip("qkv", o.split(attn.qkv_sizes, dim=-1), strict=True))
    )
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    return got


def expected_attention(model, ids: list[int], layer: int) -> torch.Tensor:
    """softmax(QKᵀ·scale), causal, (H, n, n), from a plain full forward's Q and K."""
    cfg, n = model.cfg, len(ids)
    got = q_and_k_outputs(model.layers[layer].self_attn, model, ids)
    cos, sin = rope_cos_sin(torch.arange(n), cfg.head_dim, cfg.rope_theta)
    q = apply_rope(got["q"].view(1, n, cfg.n_heads, cfg.head_dim), cos, sin)[0]
    k = apply_rope(got["k"].view(1, n, cfg.n_kv_heads, cfg.head_dim), cos, sin)[0]
    k = k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=1)  # GQA: (n, H, hd)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * cfg.scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def test_attention_equals_softmax_of_models_own_q_and_k(traced, smollm2):
    """The prompt's rows kept as it was pre-filled, the generated tokens' from the pass after
    the answer: both the model's own."""
    t, model = traced.trace.trace, smollm2.model
    ids = traced.prompt_ids + traced.output_ids[:-1]  # every token that was a query
    T, n = len(traced.prompt_ids), len(ids)
    for layer in (0, 7):
        expected = expected_attention(model, ids, layer)  # (H, n, n)
        amap = t.attention_for(layer)
        assert amap.heads == [0, 4]
        prompt = torch.tensor(amap.prompt)  # (2, T, T)
        torch.testing.assert_close(prompt, expected[[0, 4], :T, :T], atol=1e-4, rtol=0)
        assert len(amap.steps) == n - T
        for s, rows in enumerate(amap.steps):
            pos = T + s
            torch.testing.assert_close(
                torch.tensor(rows), expected[[0, 4], pos, : pos + 1], atol=1e-4, rtol=0
            )


def test_logit_lens_last_layer_is_the_models_distribution(traced, smollm2):
    t = traced.trace.trace
    ids = traced.prompt_ids + traced.output_ids
    probs = torch.softmax(smollm2.logits(ids), -1)  # (n, V); row i predicts token i + 1
    T = len(traced.prompt_ids)
    for step in t.steps:
        last = step.lens[-1]
        assert last.layer == smollm2.model.cfg.n_layers - 1
        row = probs[T - 1 + step.index]
        assert last.top[0].id == int(row.argmax()) == step.token.id  # greedy: the same token
        for c in last.top:
            assert abs(c.prob - float(row[c.id])) < 1e-4
        raw = step.stages[0]  # the raw stage is that same distribution
        assert [c.id for c in raw.top[:3]] == [c.id for c in last.top]


def test_sampling_stages_narrow_the_distribution(smollm2):
    params = SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=3,
        repetition_penalty=1.3,
        max_tokens=3,
        trace=True,
    )
    (seq,) = run(smollm2, ["The capital of India is"], [params])
    for step in seq.trace.trace.steps:
        names = [s.name for s in step.stages]
        assert names == ["raw", "penalties", "temperature", "top-k", "top-p", "min-p"]
        kept = [s.kept for s in step.stages]
        assert kept[:3] == [smollm2.model.cfg.vocab_size] * 3 and kept[3] == 20
        assert kept[3] >= kept[4] >= kept[5] >= 1
        assert step.token.prob > 0  # drawn from what the last stage kept
        final = {c.id: c.prob for c in step.stages[-1].top}
        if step.token.id in final:
            assert abs(step.token.prob - final[step.token.id]) < 1e-6


def test_untraced_neighbours_are_unchanged(smollm2):
    prompts = ["The capital of India is", "Water boils at", "One, two, three,"]
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = [s.output_ids for s in run(smollm2, prompts, [plain] * 3)]
    traced = SamplingParams(
        temperature=0,
        max_tokens=4,
        ignore_eos=True,
        trace=TraceOptions(attention_layers=[2], logit_lens=True),
    )
    mixed = run(smollm2, prompts, [plain, traced, plain])
    assert [s.output_ids for s in mixed] == alone
    assert mixed[0].trace is None and mixed[1].trace is not None
    assert len(mixed[1].trace.trace.steps) == 4
    assert all(s.batch_size == 3 for s in mixed[1].trace.trace.steps)


def test_a_cached_prompt_is_traced_whole(smollm2):
    """A prompt found in the prefix cache still gets attention rows for every position (the
    pass after the answer computes them all), equal to a fresh trace's."""
    text = "A river flows past the old mill, and the miller listens to it every night. " * 3
    ids = smollm2.encode(text)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    traced = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, trace=TraceOptions(attention_layers=[5])
    )
    (fresh,) = run(smollm2, [text + " Once"], [traced])  # another prompt: nothing cached
    smollm2.generate(ids, plain)  # fills the cache with this prompt's blocks
    (seq,) = run(smollm2, [text], [traced])
    t = seq.trace.trace
    assert t.prefill.cached_tokens > 0
    T = len(ids)
    got = torch.tensor(t.attention_for(5).prompt)  # (heads, T, T)
    want = torch.tensor(fresh.trace.trace.attention_for(5).prompt)[:, :T, :T]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (got.sum(-1) - 1).abs().max() < 1e-4  # every row a distribution


def test_a_prompt_pre_filled_in_chunks_beside_another_is_traced_as_it_runs(smollm2):
    """A prompt longer than a step's budget is pre-filled in chunks, each sharing its step
    with another request's: each chunk keeps its own attention rows and lens as it runs, equal
    to the model's own."""
    text = "The lighthouse keeper wrote down every ship that passed in the night. " * 3
    other = "Name three colours of the rainbow:"
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    options = TraceOptions(attention_layers=[3], logit_lens=True)
    traced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, trace=options)
    config = smollm2.engine.config
    budget, config.max_num_batched_tokens = config.max_num_batched_tokens, 16
    try:
        seq, _ = run(smollm2, [text, other], [traced, plain])
    finally:
        config.max_num_batched_tokens = budget
    t = seq.trace.trace
    T = len(seq.prompt_ids)
    assert len(t.prefill.chunks) >= 3
    assert any(c.batch_tokens > c.tokens for c in t.prefill.chunks)  # a step shared
    ids = seq.prompt_ids + seq.output_ids[:-1]
    assert seq.trace.missing(T) == []  # the whole prompt was kept in flight
    assert seq.trace.missing(len(ids)) == []  # and the pass after the answer did the rest
    expected = expected_attention(smollm2.model, ids, 3)
    got = torch.tensor(t.attention_for(3).prompt)
    torch.testing.assert_close(got, expected[:, :T, :T], atol=1e-4, rtol=0)
    probs = torch.softmax(smollm2.logits(seq.prompt_ids), -1)[-1]
    assert t.steps[0].lens[-1].top[0].id == int(probs.argmax()) == seq.output_ids[0]


def test_bad_trace_options_fail_when_the_request_is_added(smollm2):
    with pytest.raises(ValueError, match="attention_layers"):
        smollm2.engine.add_request(
            [1, 2], SamplingParams(trace=TraceOptions(attention_layers=[99]))
        )
    with pytest.raises(ValueError, match="trace"):
        SamplingParams(trace="yes")


# --- through the HTTP API -------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(smollm2):
    from fastapi.testclient import TestClient

    from pellucid.server import create_app

    with TestClient(create_app(smollm2, model_name="smollm2-135m")) as client:
        yield client


def test_api_trace_in_the_extension_field_openai_clients_ignore(api):
    import openai

    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=api)
    reply = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        extra_body={"trace": {"attention_layers": [1], "logit_lens": True}},
    )
    assert reply.choices[0].message.content  # an ordinary response for an ordinary client
    trace = reply.model_extra["pellucid"]["traces"]["0"]
    assert [s["token"]["piece"] for s in trace["steps"]] != []
    assert len(trace["steps"]) == reply.usage.completion_tokens
    assert trace["attention"][0]["layer"] == 1 and len(trace["steps"][0]["lens"]) == 30
    plain = api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert "traces" not in plain["pellucid"]  # untraced requests carry no trace


def test_api_rejects_a_trace_of_layers_the_model_lacks(api):
    r = api.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "trace": {"attention_layers": [30]}},
    )
    assert r.status_code == 400 and "attention_layers" in r.json()["error"]["message"]


def test_api_tokenize_and_detokenize(api):
    r = api.post("/v1/tokenize", json={"prompt": "The bank is near the river"}).json()
    assert r["tokens"] == [504, 5461, 314, 2141, 260, 4626] and r["count"] == 6
    assert r["pieces"][1] == " bank" and r["max_model_len"] > 6
    back = api.post("/v1/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "The bank is near the river"}
    bad = api.post("/v1/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


def test_api_stream_ends_with_the_trace(api):
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "trace": True}
    with api.stream("POST", "/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and len(last["pellucid"]["traces"]["0"]["steps"]) == 3
