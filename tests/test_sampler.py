"""Sampler tests: params validation, masks and penalties against hand-computed values, seeds that
repeat and ignore the batch, empirical frequencies against softmax, raw logprobs.

Run: .venv/bin/python -m pytest tests/test_sampler.py -q
"""

import math

import pytest
import torch

from pellucid.engine import sampler as sampler_module
from pellucid.engine import sampling_ops
from pellucid.engine.sampler import SamplerState, sample
from pellucid.engine.sampling_ops import (
    apply_penalties,
    apply_temperature,
    argmax_rows,
    exp_from_max,
    inverse_cdf,
    logsumexp_rows,
    min_p_mask,
    top_candidates,
    top_k_mask,
    top_p_mask,
)
from pellucid.engine.sampling_params import SamplingParams

INF = float("inf")
# Probabilities small enough to reason about by hand, in a scrambled vocabulary order.
PROBS = [0.05, 0.5, 0.15, 0.3]
LOGITS = torch.tensor(PROBS).log()


def kept(masked: torch.Tensor) -> list[set[int]]:
    """Per row, the token ids a mask left finite."""
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in masked]


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n unseeded draws from one distribution, as n rows of one batch."""
    torch.manual_seed(0)
    state = SamplerState(params, [], logits_row.shape[-1])
    return sample(logits_row.expand(n, -1), [state] * n).token_ids


def frequencies(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab_size).float() / len(token_ids)


# --- SamplingParams -------------------------------------------------------------------------


def test_params_defaults_follow_vllm_and_openai():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (256, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.ignore_eos and not p.trace and not p.is_greedy and not p.has_penalties
    assert SamplingParams().stop is not p.stop  # no shared mutable default


def test_params_accept_a_single_stop_string_and_top_k_minus_one():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("seed", "42"),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
        ("logprobs", True),
    ],
)
def test_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_error_says_what_was_given():
    with pytest.raises(ValueError, match=r"temperature must be >= 0.*got -1"):
        SamplingParams(temperature=-1)


# --- pure functions against hand-computed values --------------------------------------------


def test_apply_penalties_by_the_documented_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]]).repeat(3, 1)
    seen = torch.tensor([[True, True, True, True, False]]).repeat(3, 1)  # prompt 0, 1; output 2, 3
    counts = torch.tensor([[0, 0, 2, 1, 0]]).repeat(3, 1)
    out = apply_penalties(
        logits,
        seen,
        counts,
        repetition=torch.tensor([2.0, 1.0, 1.0]),
        presence=torch.tensor([0.25, 0.0, -0.5]),
        frequency=torch.tensor([0.5, 0.0, 0.0]),
    )
    # row 0: 2/2; -1*2; 0.5/2 - 0.5*2 - 0.25; -3*2 - 0.5*1 - 0.25; unseen token untouched
    assert out[0].tolist() == [1.0, -2.0, -1.0, -6.75, 1.0]
    assert out[1].tolist() == logits[1].tolist()  # neutral params change nothing
    # a negative presence penalty encourages generated tokens (OpenAI allows [-2, 2])
    assert out[2].tolist() == [2.0, -1.0, 1.0, -2.5, 1.0]


def test_sampler_state_tracks_prompt_and_output():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    state = SamplerState(params, [0, 1, 1], vocab_size=5)
    for token_id in (2, 2, 3):
        state.update(token_id)
    assert state.seen.tolist() == [True, True, True, True, False]
    assert state.counts.tolist() == [0, 0, 2, 1, 0]  # prompt tokens are not "generated"
    assert SamplerState(SamplingParams(), [0, 1], vocab_size=5).counts is None  # no cost if unused


def test_apply_temperature_divides_and_leaves_greedy_rows():
    logits = torch.tensor([[2.0, -4.0], [2.0, -4.0]])
    out = apply_temperature(logits, torch.tensor([2.0, 0.0]))
    assert out.tolist() == [[1.0, -2.0], [2.0, -4.0]]


def test_top_k_mask_keeps_exactly_k_per_row():
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0, 4.0]]).repeat(4, 1)
    out = top_k_mask(logits, torch.tensor([2, 0, 9, -1]))
    assert kept(out) == [{1, 4}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}]
    assert out[0, 1] == 5.0 and out[0, 4] == 4.0  # kept logits are not changed
    assert kept(top_k_mask(logits[:1], torch.tensor([3]), max_k=3)) == [{1, 2, 4}]


def test_top_k_mask_keeps_ties_with_the_kth():
    assert kept(top_k_mask(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), torch.tensor([2]))) == [{0, 1, 2}]


def test_top_p_mask_keeps_smallest_set_reaching_p():
    # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 2), 0.05 (id 0); cumulative 0.5, 0.8, 0.95, 1.0
    top_p = torch.tensor([0.4, 0.75, 0.85, 0.97, 1.0])
    out = top_p_mask(LOGITS.repeat(5, 1), top_p)
    assert kept(out) == [{1}, {1, 3}, {1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_top_p_over_a_large_vocabulary_keeps_what_sorting_it_all_keeps(monkeypatch):
    """Past TOP_P_FIRST tokens, top-p ranks only the likeliest TOP_P_FIRST and sorts the whole
    row only where the nucleus is larger: the kept sets are the full sort's."""
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(4, 5000, generator=gen) * 4  # nuclei of 2 to 544 tokens
    flat = torch.randn(1, 5000, generator=gen) * 0.01  # a nucleus of thousands: sorted whole
    masked = torch.full((1, 5000), float("-inf"))  # a grammar's mask: 3 tokens allowed
    masked[0, [7, 70, 700]] = torch.tensor([1.0, 2.0, 0.5])
    logits = torch.cat([peaked, flat, masked])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.9, 0.8])
    sorts = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(
        torch.Tensor, "sort", lambda t, *a, **k: sorts.append(1) or sort(t, *a, **k)
    )
    got = [top_p_mask(row[None], p[None]) for row, p in zip(logits, top_p)]  # row by row
    assert len(sorts) == 2  # the rows whose nucleus is larger: 0.99 of row 2, the flat row
    monkeypatch.setattr(sampling_ops, "TOP_P_FIRST", ())  # always the full sort
    want = top_p_mask(logits, top_p)
    assert [k for g in got for k in kept(g)] == kept(want)
    sizes = [len(k) for k in kept(want)]
    assert 1 < sizes[1] < 256 and sizes[2] > 256 and sizes[3] == 5000 and sizes[4] > 256
    assert sizes[5] == 2
    ids = torch.isfinite(got[1][0])
    assert torch.equal(got[1][0][ids], logits[1][ids])  # the kept logits are unchanged


def test_a_large_vocabularys_largest_are_torchs_found_chunk_by_chunk():
    """argmax_rows and top_candidates read a large row chunk by chunk: the same indices as
    torch's argmax (the first of equals), the same values as its topk, ids that hold them."""
    gen = torch.Generator().manual_seed(6)
    for vocab_size in (262_144, 49_152, 151_936):  # Gemma 3's, SmolLM2's, Qwen2's (x 128)
        logits = torch.randn(6, vocab_size, generator=gen)
        logits[1, [300, 47_000, 4000]] = 9.0  # ties in different chunks: the first wins
        logits[2, 255:257] = 9.0  # a tie across a chunk's edge
        logits[3] = float("-inf")  # a row a grammar allowed nothing in
        logits[3, vocab_size - 1] = 0.0
        logits[4, 1000:1100] = 5.0  # 100 equal values, more than k: any k of them
        logits[5] = float("-inf")
        assert argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
        assert argmax_rows(logits)[:3].tolist() == [logits[0].argmax(), 300, 255]
        for k in (1, 40, 64, 256):
            values, ids = top_candidates(logits, k)
            assert torch.equal(values, logits.topk(k).values)
            assert torch.equal(logits.gather(1, ids), values)
            assert all(len(set(row)) == k for row in ids.tolist())


def test_few_candidates_draw_what_the_whole_vocabulary_draws():
    """A seeded row with top-k, or top-p alone, draws from its few candidates (its top k; the
    TOP_P_FIRST its nucleus lies in) the token it would draw from the whole vocabulary, where a
    batch-mate without those filters sends every row there."""
    vocab_size = 65_536
    gen = torch.Generator().manual_seed(8)
    logit_steps = torch.randn(20, 2, vocab_size, generator=gen)
    peaks = torch.randint(0, vocab_size, (20, 2, 30), generator=gen)
    logit_steps.scatter_add_(2, peaks, torch.full(peaks.shape, 12.0))  # nuclei of ~30 tokens
    plain = SamplingParams(temperature=0.9)  # top_k and top_p off: the whole vocabulary
    for target in (
        SamplingParams(seed=7, temperature=0.7, top_k=40, top_p=0.9, min_p=0.01),
        SamplingParams(seed=7, temperature=0.8, top_p=0.9),
        SamplingParams(seed=7, temperature=1.3, top_p=0.95, min_p=0.05),
    ):
        alone = run_steps(logit_steps[:, 1:], 0, [SamplerState(target, [], vocab_size)])
        batch = [SamplerState(plain, [], vocab_size), SamplerState(target, [], vocab_size)]
        assert run_steps(logit_steps, 1, batch) == alone, target
        assert len(set(alone)) > 5  # really sampled, not one token over and over


def test_top_p_over_a_large_vocabulary_draws_the_renormalized_nucleus():
    vocab_size = 4096  # past TOP_P_FIRST: top-p's candidates alone are drawn from
    places = [5, 3000, 257, 4095]  # the four of PROBS, far apart
    logits = torch.zeros(vocab_size)  # the rest: ~1e-5 of the mass between them
    logits[places] = LOGITS + 20
    freq = frequencies(draw(logits, SamplingParams(top_p=0.75), 10_000), vocab_size)
    assert (freq[places] - torch.tensor([0.0, 0.625, 0.0, 0.375])).abs().max() < 0.025
    assert freq[places].sum() == 1.0


def test_top_p_one_keeps_tokens_float32_rounds_away():
    # p = 1 / (1 + 2e-13) is exactly 1.0 in float32, so the mass above the tail "reaches" 1.0
    logits = torch.tensor([[0.0, -30.0, -30.0]])
    assert kept(top_p_mask(logits, torch.tensor([1.0])))[0] == {0, 1, 2}


def test_top_p_below_float32_keeps_the_most_likely_token():
    # 5e-324 (valid in the API: in (0, 1]) is 0.0 in float32, where every mass_before "reaches" it
    # (found by the server's schema fuzzing: an all -inf row, a NaN probability in the trace)
    out = top_p_mask(LOGITS.repeat(2, 1), torch.tensor([5e-324, 0.0]))
    assert kept(out) == [{1}, {1}]


def test_min_p_mask_keeps_tokens_above_fraction_of_max():
    # p_max = 0.5; thresholds 0.1, 0.25, 0.35, 0
    out = min_p_mask(LOGITS.repeat(4, 1), torch.tensor([0.2, 0.5, 0.7, 0.0]))
    assert kept(out) == [{1, 2, 3}, {1, 3}, {1}, {0, 1, 2, 3}]


def test_draw_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 1.0, 0.0]]).repeat(2000, 1)
    assert sampling_ops.draw(probs, [None] * 2000).eq(1).all()
    # at the ends of [0, 1): the first and the last token that have any weight
    weights = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0]] * 3) * 3
    ends = torch.tensor([0.0, 1 - 2**-53, 1.0], dtype=torch.float64)  # 1.0 rounds as u * sum can
    assert inverse_cdf(weights, ends).tolist() == [1, 2, 2]
    middle = torch.tensor([0.24, 0.26, 0.5], dtype=torch.float64)  # 0.25 of the sum is token 1's
    assert inverse_cdf(weights, middle).tolist() == [1, 2, 2]


def test_a_whole_vocabulary_is_drawn_from_in_two_steps_as_in_one():
    """inverse_cdf over a long row goes chunk, then place within the chunk: the index one
    running sum over the whole row gives, and never a weight of 0."""
    gen = torch.Generator().manual_seed(9)
    weights = torch.rand(4, 65_536, generator=gen) ** 8  # from ~1 down to ~1e-30
    weights[:, ::3] = 0.0
    weights[1, :40_000] = 0.0  # a row whose first 40,000 are out
    running = weights.double().cumsum(-1)
    for _ in range(50):
        uniform = torch.rand(4, dtype=torch.float64, generator=gen)
        one_step = torch.searchsorted(running, uniform[:, None] * running[:, -1:], right=True)
        assert inverse_cdf(weights, uniform).tolist() == one_step.squeeze(1).tolist()
    ends = inverse_cdf(weights[1:2].expand(2, -1), torch.tensor([0.0, 1.0], dtype=torch.float64))
    nonzero = weights[1].nonzero().squeeze(1)
    assert ends.tolist() == [nonzero[0], nonzero[-1]]


def test_probabilities_without_subnormals_are_torchs():
    """exp_from_max and logsumexp_rows skip exp's subnormal results (a row at temperature 0.2):
    the same probabilities, to float32's precision, and -inf stays out."""
    logits = torch.randn(3, 49_152, generator=torch.Generator().manual_seed(10)) * 3 / 0.2
    logits[2, 100:] = float("-inf")
    probs = exp_from_max(logits)
    want = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), want, rtol=1e-5, atol=2e-38)
    assert probs[2, 100:].eq(0).all() and probs.amax(-1).eq(1).all()
    torch.testing.assert_close(logsumexp_rows(logits), logits.logsumexp(-1, keepdim=True))


@pytest.mark.parametrize("width", [49_152, 50_257])  # runs of SUM_RUN, and a tail
def test_a_rows_logsumexp_is_the_same_alone_and_beside_others(width):
    """With two threads torch shared a lone row's sum between them and gave each row of a batch
    to one: a reply's logprobs changed in the last bits with the requests beside it. (The test
    of whole replies in any company, in tests/test_quant.py, runs one thread under make test.)"""
    logits = torch.randn(12, width, generator=torch.Generator().manual_seed(11)) * 4
    weights = exp_from_max(logits)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sums = sampling_ops.row_sums(weights)
        assert torch.equal(torch.cat([sampling_ops.row_sums(w[None]) for w in weights]), sums)
        total = logsumexp_rows(logits)
        assert torch.equal(torch.cat([logsumexp_rows(row[None]) for row in logits]), total)
    finally:
        torch.set_num_threads(threads)
    want = logits.double().logsumexp(-1, keepdim=True).float()
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)


# --- sample(): greedy, temperature, seeds ----------------------------------------------------


def test_greedy_is_argmax_with_first_index_on_ties():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    logits[3] = torch.tensor([1.0, 3.0, 3.0] + [0.0] * 47)
    states = [SamplerState(SamplingParams(temperature=0), [], 50)] * 4
    out = sample(logits, states).token_ids
    assert out[:3].tolist() == logits[:3].argmax(-1).tolist() and out[3] == 1


def test_greedy_rows_stay_argmax_in_a_sampling_batch():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(5))
    states = [
        SamplerState(SamplingParams(temperature=0 if i % 2 else 1.5), [], 100) for i in range(64)
    ]
    out = sample(logits, states).token_ids
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    assert out[0::2].tolist() != logits[0::2].argmax(-1).tolist()  # the others really sample


def test_greedy_uses_penalized_logits():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    plain = SamplerState(SamplingParams(temperature=0), [0], 3)
    penalized = SamplerState(SamplingParams(temperature=0, repetition_penalty=1.1), [0], 3)
    assert sample(logits, [plain]).token_ids.item() == 0
    assert sample(logits, [penalized]).token_ids.item() == 1  # 2 / 1.1 = 1.82 < 1.9


def test_frequency_penalty_grows_with_repeats_and_presence_ignores_prompt():
    logits = torch.tensor([[1.0, 0.8]])
    state = SamplerState(SamplingParams(temperature=0, frequency_penalty=0.15), [], 2)
    assert sample(logits, [state]).token_ids.item() == 0
    state.update(0)  # 1.0 - 0.15 = 0.85 > 0.8: still 0
    assert sample(logits, [state]).token_ids.item() == 0
    state.update(0)  # 1.0 - 0.30 = 0.70 < 0.8
    assert sample(logits, [state]).token_ids.item() == 1
    prompt_only = SamplerState(SamplingParams(temperature=0, presence_penalty=2.0), [0], 2)
    assert sample(logits, [prompt_only]).token_ids.item() == 0


def test_where_a_tool_calls_argument_value_begins_no_penalty_applies():
    # Token 0 stands for ` "` (a value's opening quote, used by every earlier value of the call),
    # token 1 for ` "",` (a whole empty string, never used): counted, the penalty picks 1.
    logits = torch.tensor([[1.0, 0.8]])
    state = SamplerState(SamplingParams(temperature=0, frequency_penalty=0.5), [], 2)
    state.update(0)
    state.json_at = "outside"  # elsewhere in the call the penalty holds: 1.0 - 0.5 < 0.8
    assert sample(logits, [state]).token_ids.item() == 1
    state.json_at = "value"  # a key's colon came last
    assert sample(logits, [state]).token_ids.item() == 0
    assert state.counts.tolist() == [1, 0]  # the count itself stays, for the steps after
    # in a batch, only that row goes unpenalized
    other = SamplerState(SamplingParams(temperature=0, frequency_penalty=0.5), [], 2)
    other.update(0)
    assert sample(logits.expand(2, -1), [state, other]).token_ids.tolist() == [0, 1]


def test_temperature_to_zero_becomes_argmax():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])  # gaps >= 1: at T=0.01 others have p < e^-100
    assert draw(logits, SamplingParams(temperature=0.01), 1000).eq(1).all()
    assert draw(logits, SamplingParams(temperature=1e-7), 10).eq(1).all()  # below 1e-5: greedy


def run_steps(logit_steps: torch.Tensor, row: int, states: list[SamplerState]) -> list[int]:
    """Sample every step of logit_steps (T, B, V), update histories, return row's tokens."""
    tokens = []
    for logits in logit_steps:
        token_ids = sample(logits, states).token_ids.tolist()
        for state, token_id in zip(states, token_ids):
            state.update(token_id)
        tokens.append(token_ids[row])
    return tokens


def test_seeded_rows_repeat_and_seeds_differ():
    logit_steps = torch.randn(30, 1, 1000, generator=torch.Generator().manual_seed(2))

    def tokens(seed: int) -> list[int]:
        return run_steps(logit_steps, 0, [SamplerState(SamplingParams(seed=seed), [], 1000)])

    assert tokens(1234) == tokens(1234)
    assert tokens(1234) != tokens(1235)


def test_seeded_row_ignores_the_rest_of_the_batch():
    vocab_size = 200
    logit_steps = torch.randn(20, 4, vocab_size, generator=torch.Generator().manual_seed(3))
    target = SamplingParams(
        seed=7,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
    )
    alone = run_steps(logit_steps[:, 2:3], 0, [SamplerState(target, [5, 6], vocab_size)])
    others = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(seed=99, presence_penalty=1.0),
    ]  # top_k off: the full-V path
    batch = [SamplerState(p, [1], vocab_size) for p in others]
    batch.insert(2, SamplerState(target, [5, 6], vocab_size))
    torch.manual_seed(123)  # the unseeded row's draws must not matter either
    assert run_steps(logit_steps, 2, batch) == alone


# --- empirical distributions ---------------------------------------------------------------


def test_frequencies_match_softmax_over_temperature():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.8])
    n = 20_000
    counts = torch.bincount(draw(logits, SamplingParams(temperature=0.7), n), minlength=6)
    expected = torch.softmax(logits / 0.7, dim=-1) * n
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5  # 5 degrees of freedom: exceeded with probability 0.001


def test_seeded_rows_draw_from_softmax():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5]).expand(4000, -1)
    states = [SamplerState(SamplingParams(seed=s), [], 4) for s in range(4000)]
    freq = frequencies(sample(logits, states).token_ids, 4)
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.03


def test_top_k_support_over_many_draws():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.8, -0.5, 0.3])
    assert set(draw(logits, SamplingParams(top_k=3), 4000).tolist()) == {1, 3, 5}
    assert set(draw(logits, SamplingParams(top_k=-1), 4000).tolist()) == set(range(8))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=3, top_p=0.8),  # top-3 {1, 3, 2} renormalized: 0.53, 0.32, 0.16
        SamplingParams(top_p=0.75),  # the full-vocabulary path
        SamplingParams(min_p=0.5),  # threshold 0.25
    ],
)
def test_filtered_frequencies_are_renormalized(params):
    freq = frequencies(draw(LOGITS, params, 10_000), 4)
    assert (freq - torch.tensor([0.0, 0.625, 0.0, 0.375])).abs().max() < 0.025


# --- logprobs, errors, fast path -------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(logprobs=2, temperature=0.5, repetition_penalty=1.5, seed=1),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
    ]
    out = sample(logits, [SamplerState(p, [0, 1, 2], 20) for p in params])
    raw = logits - logits.exp().sum(-1, keepdim=True).log()  # log softmax, written out
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    top2 = logits[0].argsort(descending=True)[:2]
    assert out.top_token_ids.shape == (3, 2) and out.top_token_ids[0].tolist() == top2.tolist()
    torch.testing.assert_close(out.top_logprobs[0], raw[0, top2])
    assert out.token_ids[2] == logits[2].argmax()  # the greedy row, in a batch that samples
    assert sample(logits, [SamplerState(SamplingParams(), [], 20)] * 3).logprobs is None


def test_logprobs_over_a_large_vocabulary_are_float64s():
    """Over Gemma 3's 262,144 logits the logprobs are log_softmax's in float64 to 1e-5 (torch's
    float32 log_softmax errs by ~5e-5 there), and the top ones its ranking."""
    logits = torch.randn(2, 262_144, generator=torch.Generator().manual_seed(11)) * 4
    states = [SamplerState(SamplingParams(logprobs=5, temperature=0), [], 262_144)] * 2
    out = sample(logits, states)
    exact = torch.log_softmax(logits.double(), dim=-1)
    top = exact.topk(5)
    assert out.top_token_ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(out.top_logprobs.double(), top.values, rtol=0, atol=1e-5)
    chosen = exact.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), chosen, rtol=0, atol=1e-5)


def test_wrong_vocab_or_prompt_ids_raise_value_error():
    penalized = SamplingParams(repetition_penalty=1.2)
    with pytest.raises(ValueError, match="vocab"):
        sample(torch.zeros(1, 12), [SamplerState(penalized, [0], vocab_size=10)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplerState(penalized, [3, 10], vocab_size=10)


def test_plain_rows_skip_penalties_and_filters(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("called on the fast path")

    for name in ("apply_penalties", "apply_temperature", "top_k_mask", "top_p_mask", "min_p_mask"):
        monkeypatch.setattr(sampler_module, name, forbidden)
    logits = torch.randn(3, 10)
    plain = [SamplerState(SamplingParams(seed=0), [], 10)] * 3
    assert sample(logits, plain).token_ids.shape == (3,)
    monkeypatch.setattr(sampler_module, "draw", forbidden)
    greedy = sample(logits, [SamplerState(SamplingParams(temperature=0), [], 10)] * 3)
    assert greedy.token_ids.tolist() == logits.argmax(-1).tolist()
