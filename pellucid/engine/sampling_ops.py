"""The sampler's stages as pure functions on a batch of logits (B, V), one parameter per row:
penalties, temperature, top-k, top-p, min-p, and the draw. sampler.py applies them in order,
only to the rows whose params ask for each.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

NEG_INF = float("-inf")
# Tokens top-p looks at first: a trained model's nucleus nearly always lies among them, and
# their top-k is far cheaper than sorting a whole vocabulary every step, which made sampled
# decoding much slower than greedy (benchmarks/results/comments.md). Where a row's nucleus is
# larger (a flat distribution), the whole row is sorted, as before.
TOP_P_FIRST = 256


def apply_penalties(
    logits: Tensor,
    seen: Tensor,
    counts: Tensor,
    repetition: Tensor,
    presence: Tensor,
    frequency: Tensor,
) -> Tensor:
    """Penalize tokens a sequence has already produced.

    logits (B, V); seen (B, V) bool, token in prompt or output; counts (B, V), times generated;
    repetition, presence, frequency (B,).
    Repetition (HF, llama.cpp, vLLM), for seen tokens: l / r if l > 0 else l * r. Dividing alone
    would make a negative logit *more* likely, hence the two cases.
    Presence and frequency (OpenAI), on generated tokens:
    l - frequency * count - presence * [count > 0].
    """
    r = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    counts = counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide row i by temperature[i]; rows at 0 are greedy and left alone. logits (B, V)."""
    t = torch.where(temperature > 0, temperature, 1.0)
    return logits / t[:, None]


def top_k_mask(logits: Tensor, top_k: Tensor, max_k: int | None = None) -> Tensor:
    """Keep row i's top_k[i] largest logits, -inf elsewhere; top_k <= 0 keeps all. logits (B, V).

    Ties with the k-th value are kept (as HF does). max_k, the largest k in the batch, is known
    on the host when the caller built top_k; passing it spares a device sync.
    """
    vocab_size = logits.shape[-1]
    k = top_k.clamp(max=vocab_size)
    max_k = int(k.max()) if max_k is None else min(max_k, vocab_size)
    if max_k <= 0:
        return logits
    best = logits.topk(max_k, dim=-1).values  # (B, max_k), descending
    kth = best.gather(1, (k - 1).clamp(min=0)[:, None])  # (B, 1)
    kth = torch.where(k[:, None] > 0, kth, NEG_INF)  # k off: nothing lies below -inf
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p[i].

    logits (B, V); rows with top_p >= 1 keep all: in float32 the mass above a tail token can
    round to 1.0 (p = 1 - 1e-13 is 1.0), which would otherwise cut the tail of an untouched row.
    The most likely token always stays: a top_p too small for float32 (5e-324 is 0.0 there)
    would otherwise drop it too and leave nothing to sample.
    """
    if logits.shape[-1] > TOP_P_FIRST:
        values, order = logits.topk(TOP_P_FIRST, dim=-1)  # (B, k), descending
        probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        # every row's nucleus ends within the first k (its k-th token is already out: so is
        # every token after it), or the row keeps all
        if bool(((mass_before[:, -1] >= top_p) | (top_p >= 1)).all()):
            return _drop_past_nucleus(logits, mass_before, order, top_p, keep=False)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    return _drop_past_nucleus(logits, mass_before, order, top_p, keep=True)


def _drop_past_nucleus(
    logits: Tensor, mass_before: Tensor, order: Tensor, top_p: Tensor, keep: bool
) -> Tensor:
    """-inf where the tokens ranked by `order` (B, n) have mass_before >= top_p (top_p < 1 only,
    the first always kept); tokens past the n ranked ones are kept or dropped by `keep`."""
    drop_ranked = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop_ranked[:, 0] = False
    drop = torch.full_like(logits, not keep, dtype=torch.bool)
    drop[top_p >= 1] = False
    drop.scatter_(1, order, drop_ranked)  # back to vocabulary order
    return logits.masked_fill(drop, NEG_INF)


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens with p >= min_p[i] * p_max, -inf elsewhere. logits (B, V).

    In logit space that is l >= l_max + log(min_p): no softmax needed, and min_p = 0 gives a
    threshold of -inf, which keeps everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]  # (B, 1)
    return logits.masked_fill(logits < threshold, NEG_INF)


def exponential_race(
    probs: Tensor, generators: Sequence[torch.Generator | None], skip: Sequence[bool] | None = None
) -> Tensor:
    """Draw one token per row of probs (B, V), without a device sync.

    With E_i ~ Exp(1), E_i / p_i ~ Exp(rate p_i), and the smallest of independent exponentials
    is i with probability p_i / sum(p): so argmax(p / E) is a draw from p (gpt-fast, vLLM).
    Row i's noise comes from generators[i] alone (None: torch's default generator), so a seeded
    row draws the same tokens whatever else is in the batch. Rows in `skip` draw nothing.
    """
    skip = skip or [False] * len(generators)
    uniform = torch.empty_like(probs)
    if any(g is None and not s for g, s in zip(generators, skip)):
        uniform.uniform_()  # one call for every unseeded row; seeded rows are overwritten next
    for row, (generator, skipped) in enumerate(zip(generators, skip)):
        if generator is not None and not skipped:
            uniform[row].uniform_(generator=generator)
    # -log(U) ~ Exp(1), and several times faster on CPU than exponential_(). U < 1 keeps the noise
    # > 0, so a masked token scores 0 / noise = 0 and can never win (no 0 / 0 = NaN).
    noise = uniform.log_().neg_()
    return (probs / noise).argmax(dim=-1)
