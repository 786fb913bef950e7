"""Looking inside the engine's forward pass and changing it (models/probes.py, probing.py).

References are computed apart from the engine: PyTorch forward hooks on a plain full forward of
the same model (no KV cache, no batching, no probe), which the engine's paged, batched, chunked
passes must match; patching is checked on a real model against what is known of it.
"""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest
import torch
from helpers import MODEL
from torch import Tensor, nn

from pellucid import LLM, SamplingParams
from pellucid.config import EngineConfig
from pellucid.engine.probes import ablate, hook_name, hook_names, patch, steer
from pellucid.probing import (
    activation_patching,
    interventions_from_json,
    mean_ablation,
    steering_vector,
)

SEA = [{"role": "user", "content": "Write a sentence about the sea."}]
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."


@pytest.fixture(scope="module")
def chunked(tiny_path) -> LLM:
    """The tiny model pre-filling at most 16 tokens a step (a prompt spans several chunks), and
    no prefix cache (every request computes its prompt alike)."""
    config = EngineConfig(max_num_batched_tokens=16, enable_prefix_caching=False)
    return LLM(tiny_path, dtype="float32", engine=config)


def hooked_forward(
    model: nn.Module, ids: list[int], edit: dict[str, object] | None = None
) -> dict[str, Tensor]:
    """A plain full forward (ctx=None) with PyTorch hooks keeping what the probe names, and
    `edit` (hook name -> function of the tensor) changing it: the reference."""
    kept: dict[str, Tensor] = {}
    edit = edit or {}
    handles = []

    def output_hook(name: str):
        def hook(module, args, out):
            out = edit[name](out) if name in edit else out
            kept[name] = out[0].detach().clone()
            return out

        return hook

    def z_hook(name: str, heads: int):
        def hook(module, args):
            (x,) = args
            z = x.unflatten(-1, (heads, -1))
            z = edit[name](z) if name in edit else z
            kept[name] = z[0].detach().clone()
            return (z.flatten(-2),)

        return hook

    for i, block in enumerate(model.layers):
        handles.append(block.register_forward_hook(output_hook(hook_name("resid_post", i))))
        attn = block.self_attn
        handles.append(attn.register_forward_hook(output_hook(hook_name("attn_out", i))))
        handles.append(
            attn.o_proj.register_forward_pre_hook(z_hook(hook_name("z", i), attn.n_heads))
        )
        handles.append(block.mlp.register_forward_hook(output_hook(hook_name("mlp_out", i))))
    handles.append(model.norm.register_forward_hook(output_hook("ln_final.hook_normalized")))
    try:
        with torch.inference_mode():
            kept["hook_logits"] = model(torch.tensor([ids]))[0]
    finally:
        for h in handles:
            h.remove()
    return kept


def close(a: Tensor, b: Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def test_run_with_cache_matches_a_hooked_forward_across_chunks(chunked):
    ids = chunked.encode(PROMPT)
    assert len(ids) > 3 * 16  # the engine pre-fills it in several steps
    logits, cache = chunked.run_with_cache(PROMPT)
    assert set(cache) == set(hook_names(chunked.model.cfg))
    reference = hooked_forward(chunked.model, ids)
    for name, want in reference.items():
        assert close(cache[name], want), name
    assert close(logits, reference["hook_logits"])
    # the residual stream into block 1 is the one out of block 0
    assert torch.equal(cache["blocks.1.hook_resid_pre"], cache["blocks.0.hook_resid_post"])


def test_pattern_q_k_v_and_z_agree_with_each_other(chunked):
    """The kept pattern is softmax(q k^T) under the causal mask, and z = pattern @ v, per head
    and its K/V group."""
    cfg = chunked.model.cfg
    _, cache = chunked.run_with_cache(
        PROMPT, [hook_name(s, 1) for s in ("q", "k", "v", "pattern", "z")]
    )
    q, k, v = (cache[hook_name(s, 1)] for s in "qkv")  # (T, H, hd), (T, Hkv, hd)
    group = cfg.n_heads // cfg.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * cfg.scale
    T = len(q)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    pattern = cache[hook_name("pattern", 1)]
    assert close(pattern, scores.softmax(-1))
    assert close(cache[hook_name("z", 1)], torch.einsum("hts,shd->thd", pattern, v))


def test_the_last_layer_read_through_the_head_is_the_models_output(tiny):
    """The logit lens at the last layer: final norm + LM head of the last residual stream."""
    last = hook_name("resid_post", tiny.model.cfg.n_layers - 1)
    logits, cache = tiny.run_with_cache(PROMPT, [last])
    with torch.inference_mode():
        lens = tiny.model.compute_logits(tiny.model.norm(cache[last]))
    assert close(lens, logits)


def test_unknown_hook_names_are_refused_with_the_valid_range(tiny):
    with pytest.raises(ValueError, match="blocks.0.hook_resid_pre"):
        tiny.run_with_cache(PROMPT, ["blocks.9.hook_resid_post"])


def _edited_logits(llm: LLM, ivs: list) -> Tensor:
    logits, _ = llm.run_with_cache(PROMPT, [], ivs)
    return logits


def test_ablation_steering_and_patching_match_the_same_edits_made_by_hooks(chunked):
    model, ids = chunked.model, chunked.encode(PROMPT)
    cfg = model.cfg

    def zero_heads(z):
        z = z.clone()
        z[..., [0, 2], :] = 0
        return z

    vector = torch.randn(cfg.dim, generator=torch.Generator().manual_seed(1))
    value = torch.randn(cfg.dim, generator=torch.Generator().manual_seed(2))

    def patch_10(x):
        x = x.clone()
        x[0, 10] = value
        return x

    cases = [
        ([ablate(1, [0, 2])], {hook_name("z", 1): zero_heads}),
        ([steer(0, vector, 0.5)], {hook_name("resid_post", 0): lambda x: x + 0.5 * vector}),
        ([patch(0, 10, value)], {hook_name("resid_post", 0): patch_10}),
    ]
    plain = hooked_forward(model, ids)["hook_logits"]
    for ivs, hooks in cases:
        got = _edited_logits(chunked, ivs)
        want = hooked_forward(model, ids, hooks)["hook_logits"]
        assert close(got, want), ivs[0].kind
        assert not close(got, plain), ivs[0].kind  # the edit did change something


def test_a_patch_changes_nothing_before_its_position(tiny):
    clean = tiny.run_with_cache(PROMPT, [])[0]
    got = _edited_logits(tiny, [patch(1, 20, torch.zeros(tiny.model.cfg.dim))])
    assert torch.equal(got[:20], clean[:20])
    assert not close(got[20:], clean[20:])


def test_batch_mates_of_an_intervened_request_are_untouched(chunked):
    """A batch of two plain requests, then the same batch with the second one ablated: the
    first one's tokens and log-probabilities are the same bits (the random tiny model repeats
    one token, so its logprobs tell more)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ablated = replace(params, interventions=[ablate(0, [0, 1, 2, 3])])
    plain, _ = chunked.generate([PROMPT, PROMPT], [params, params])
    with_mate, mate = chunked.generate([PROMPT, PROMPT], [params, ablated])
    assert with_mate.token_ids == plain.token_ids and with_mate.logprobs == plain.logprobs
    assert mate.logprobs != plain.logprobs


def test_the_prefix_cache_keeps_kv_of_different_interventions_apart(tiny):
    """A plain run, the same prompt ablated, the plain prompt again: the ablated request never
    reads the plain KV (nor the plain one the ablated KV), and the same intervention shares."""
    engine = tiny.engine
    long = PROMPT * 3  # several full blocks to share
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    ablated = replace(params, interventions=[ablate(1, [0, 1, 2, 3])])

    def run(p: SamplingParams) -> tuple[Tensor, int]:
        hits = engine.block_manager.hits
        out = tiny.generate(long, p)[0]
        return torch.tensor([lp.logprob for lp in out.logprobs]), engine.block_manager.hits - hits

    first, _ = run(params)
    changed, hits_ablated = run(ablated)
    again, hits_plain = run(params)
    twice, hits_same = run(ablated)
    # (a cached prefix and a computed one round apart in the last bits)
    assert not close(changed, first) and close(again, first) and close(twice, changed)
    assert hits_ablated == 0  # nothing computed without the ablation was served to it
    assert hits_plain > 0 and hits_same > 0  # equal interventions do share


@pytest.mark.parametrize(
    "bad, message",
    [
        (ablate(7, [0]), "layer 7 does not exist: the model has layers 0..1"),
        (ablate(0, [4]), r"heads \[4\] do not exist: the model has heads 0..3"),
        (steer(0, torch.ones(3)), r"must be a number or of shape \[64\]"),
        (patch(0, 5000, torch.zeros(64)), r"positions \[5000\] are outside the context"),
        (steer(0, torch.full((64,), float("nan"))), "not finite"),
    ],
)
def test_bad_interventions_are_refused_before_any_step(tiny, bad, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate(PROMPT, SamplingParams(interventions=[bad]))


def test_json_interventions_are_read_and_checked(tiny):
    cfg = tiny.model.cfg
    ivs = interventions_from_json(
        tiny,
        [
            {"type": "ablate", "layer": 1, "heads": [0, 1]},
            {"type": "ablate", "layer": 0, "heads": [2], "mode": "mean", "mean_over": PROMPT},
            {"type": "steer", "layer": 0, "prompts": ["good day", "bad day"], "scale": 2},
            {"type": "steer", "layer": 1, "vector": [0.5] * cfg.dim},
            {"type": "patch", "layer": 1, "position": 2, "from_prompt": "abcdef"},
            {"type": "patch", "layer": 1, "position": 2, "head": 3, "value": [1.0] * cfg.head_dim},
        ],
        PROMPT,
    )
    assert [iv.kind for iv in ivs] == ["ablate", "ablate", "steer", "steer", "patch", "patch"]
    assert torch.equal(ivs[1].value, mean_ablation(tiny, 0, [2], PROMPT).value)
    assert torch.equal(ivs[2].value, 2 * steering_vector(tiny, "good day", "bad day", 0))
    for spec, message in [
        ({"type": "mute", "layer": 0}, r"interventions\[0\].type must be one of"),
        ({"type": "ablate", "layer": 0}, r"interventions\[0\].heads is required"),
        ({"type": "ablate", "layer": 9, "heads": [0]}, r"interventions\[0\]: layer 9 does not"),
        ({"type": "ablate", "layer": 0, "heads": [0], "mode": "x"}, "mode must be 'zero' or"),
        ({"type": "steer", "layer": 0, "vector": [1.0]}, r"shape \[64\]"),
        ({"type": "steer", "layer": 0, "vector": [1.0] * 64, "scal": 2}, "unknown fields"),
        ({"type": "patch", "layer": 0, "position": 9, "from_prompt": "ab"}, "outside from_prompt"),
    ]:
        with pytest.raises(ValueError, match=message):
            interventions_from_json(tiny, [spec], PROMPT)


def test_intervening_changes_the_answer_and_removing_it_restores_it(smollm2):
    """On SmolLM2 with the prefix cache on: all heads of one layer ablated, or a steering
    vector added, change the greedy answer; the plain request afterwards is the first one, token
    for token."""
    prompt = smollm2.chat_prompt(SEA)
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = smollm2.generate(prompt, params)[0].token_ids
    heads = list(range(smollm2.model.cfg.n_heads))
    vector = steering_vector(
        smollm2, "I love this, it makes me happy", "I hate this, it makes me angry", 6
    )
    for iv in (ablate(3, heads), steer(6, vector, 4.0)):
        changed = smollm2.generate(prompt, replace(params, interventions=[iv]))
        assert changed[0].token_ids != plain, iv.kind
        assert smollm2.generate(prompt, params)[0].token_ids == plain, iv.kind


def test_patching_finds_where_the_country_is_carried(smollm2):
    """France -> Italy: patching the clean residual stream at " France" restores " Paris" in
    the early layers, and at the last position in the late ones, where the answer is read out."""
    p = activation_patching(smollm2, "The capital of France is", "The capital of Italy is")
    assert p.answers == (" Paris", " Rome")
    country, last = p.tokens.index(" France"), len(p.tokens) - 1
    assert p.scores[0, country] > 0.9 and p.scores[0, last] < 0.1
    assert p.scores[-1, last] > 0.9 and p.scores[-1, country] < 0.1
    assert p.scores[:, :country].abs().max() < 0.05  # what comes before it knows nothing of it


# --- through the server --------------------------------------------------------------------
def _ask(client: openai.OpenAI, interventions: list | None = None, stream: bool = False) -> str:
    extra = {"interventions": interventions} if interventions else None
    kwargs = {
        "model": MODEL,
        "messages": SEA,
        "temperature": 0,
        "max_tokens": 20,
        "extra_body": extra,
    }
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_server_applies_interventions_streamed_or_not(client):
    plain = _ask(client)
    ablated = [{"type": "ablate", "layer": 3, "heads": list(range(9))}]
    steered = [
        {"type": "steer", "layer": 6, "prompts": ["I love this", "I hate this"], "scale": 4},
        {"type": "ablate", "layer": 20, "heads": [0, 1], "mode": "mean"},
    ]
    for ivs in (ablated, steered):
        changed = _ask(client, ivs)
        assert changed != plain
        assert _ask(client, ivs, stream=True) == changed
        assert _ask(client) == plain  # and gone with the next request


def test_the_server_refuses_bad_interventions_and_goes_on(client):
    for ivs, message in [
        ([{"type": "ablate", "layer": 30, "heads": [0]}], "layer 30 does not exist"),
        ([{"type": "ablate", "layer": 0, "heads": [9]}], "heads 0..8"),
        ([{"type": "steer", "layer": 0, "vector": [1.0, 2.0]}], r"shape \[576\]"),
        ([{"type": "patch", "layer": 0, "position": 99999, "value": [0.0] * 576}], "outside"),
        ({"type": "ablate"}, "Input should be a valid list"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as error:
            _ask(client, ivs)
        assert error.value.status_code == 400
    assert _ask(client)  # still serving


def test_one_positions_view_read_over_the_prefix_cache_is_the_full_passes(tiny):
    """inspect_position computes only the last position, its context from the prefix cache:
    33 tokens leave one to compute after two cached blocks, 40 leave a chunk."""
    from pellucid.probing import inspect_position

    for n in (33, 40):
        ids = tiny.encode(PROMPT * 2)[:n]
        tiny.generate(ids, SamplingParams(temperature=0, max_tokens=1))  # its blocks, cached
        hits = tiny.engine.block_manager.hits
        view = inspect_position(tiny, ids, n - 1)
        assert tiny.engine.block_manager.hits - hits == 32  # two blocks of 16 read, not computed
        _, cache = tiny.run_with_cache(ids, [hook_name("pattern", 1)])
        want = cache[hook_name("pattern", 1)][:, -1]
        assert torch.allclose(torch.tensor(view["attention"][1]["heads"]), want, atol=1e-5)
        logits = tiny.logits(ids)[-1].softmax(-1)
        assert view["lens"][-1]["top"][0]["id"] == int(logits.argmax())
        assert view["lens"][-1]["top"][0]["prob"] == pytest.approx(float(logits.max()), abs=1e-4)
