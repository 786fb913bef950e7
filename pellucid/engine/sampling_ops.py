"""The sampler's stages as pure functions on a batch of logits (B, V), one parameter per row:
penalties, temperature, top-k, top-p, min-p, and the draw. sampler.py applies them in order,
only to the rows whose params ask for each. Each stage also takes a row's candidates alone (B, N)
(its likeliest N, found by `top_candidates`): with a large vocabulary, a pass over the whole row
costs more than the sampling itself.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

NEG_INF = float("-inf")
# Tokens top-p looks at first, then next: a trained model's nucleus nearly always lies among
# them (at temperature 0.2, among its first few), and their top-k is far cheaper than sorting a
# whole vocabulary every step, which made sampled decoding much slower than greedy
# (benchmarks/results/comments.md). Where a row's nucleus is larger (a flat distribution), the
# whole row is sorted.
TOP_P_FIRST = (32, 256)
# A row's largest values are found chunk by chunk: each chunk's maximum is a vectorized
# reduction, where torch's argmax and topk walk a row one element at a time (over Gemma 3's
# 262,144 logits they took longer than the rest of the sampler: benchmarks/results/comments.md).
# The first of these sizes that divides the vocabulary.
CHUNK_SIZES = (256, 128, 64)
SUM_RUN = 256  # values a row's sum adds up before the runs' sums are added (row_sums)
# Below this, exp leaves float32's normal range (e^-87.3 is its smallest normal number, 1.2e-38):
# a CPU takes far longer over subnormal results (benchmarks/results/comments.md), which are
# most of a row at temperature 0.2, and whose weight next to the row's largest, e^0 = 1, is nil.
EXP_FLOOR = -87.0
FLOOR_WEIGHT = math.exp(EXP_FLOOR)


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


def _chunked(logits: Tensor, k: int) -> Tensor | None:
    """logits (B, V) as chunks (B, V / size, size), where a size of CHUNK_SIZES divides V into at
    least 4k chunks (so that k of them are a quarter of the row or less); else None."""
    for size in CHUNK_SIZES:
        if logits.shape[-1] % size == 0 and logits.shape[-1] // size >= 4 * k:
            return logits.reshape(logits.shape[0], -1, size)
    return None


def argmax_rows(logits: Tensor) -> Tensor:
    """Each row's index of its largest value (B,), the first of equals: logits.argmax(-1)."""
    chunks = _chunked(logits, 16)  # 64 chunks or more: over a short row torch's is as quick
    if chunks is None:
        return logits.argmax(dim=-1)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # (B,) the first chunk holding the row's largest
    rows = torch.arange(len(best), device=logits.device)
    return best * chunks.shape[-1] + chunks[rows, best].argmax(dim=-1)


def top_candidates(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k largest logits, descending, and their token ids (B, k): logits.topk(k).

    They lie in the k chunks with the largest maxima: those hold k values at or above the k-th
    of those maxima (their own), and no other chunk holds a value above it. So only those
    chunks are ranked. (Values equal to that k-th maximum may come from other chunks than
    topk's, which leaves the ids of equal values in no set order either.)
    """
    chunks = _chunked(logits, k)
    if chunks is None:
        return logits.topk(k, dim=-1)
    rows, _, size = chunks.shape
    picked = chunks.amax(dim=-1).topk(k, dim=-1).indices  # (B, k) chunk numbers
    within = chunks.gather(1, picked[..., None].expand(rows, k, size)).view(rows, k * size)
    values, at = within.topk(k, dim=-1)  # (B, k) places in `within`
    return values, picked.gather(1, at // size) * size + at % size


def exp_from_max(logits: Tensor) -> Tensor:
    """exp(logits - each row's largest) (B, N), 0 below EXP_FLOOR: the row's probabilities times
    a constant, its largest 1. (A row of -inf alone gives NaN.)"""
    shifted = (logits - logits.amax(dim=-1, keepdim=True)).clamp_(min=EXP_FLOOR)
    return F.threshold_(shifted.exp_(), FLOOR_WEIGHT, 0.0)  # exp(EXP_FLOOR) itself to 0


def logsumexp_rows(logits: Tensor) -> Tensor:
    """log(sum(exp(logits))) of each row (B, 1), as torch.logsumexp, without its subnormals."""
    largest = logits.amax(dim=-1, keepdim=True)
    return largest + row_sums(exp_from_max(logits)).log()


def row_sums(x: Tensor) -> Tensor:
    """Each row's sum (B, 1), added in one order whatever the rows beside it and the threads.

    torch shares a lone row's long sum among its threads, but sums a batch a row per thread: a
    reply's logprobs then changed in the last bits with its company (alone, or beside the other
    requests of a step). Summed by runs of SUM_RUN, each run's sum by one thread, then the runs'
    sums (too few to share), the order is the same for every row in every batch.
    """
    rows, n = x.shape
    whole = n - n % SUM_RUN
    sums = x[:, :whole].reshape(rows, -1, SUM_RUN).sum(dim=-1)  # (B, n / SUM_RUN)
    if whole < n:
        sums = torch.cat([sums, x[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    return sums.sum(dim=-1, keepdim=True)


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
    first = _nucleus_among_first(logits, top_p)
    if first is not None:
        _, order, mass_before = first
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
    drop = torch.full_like(logits, not keep, dtype=torch.bool)
    drop[top_p >= 1] = False
    drop.scatter_(1, order, _past_nucleus(mass_before, top_p))  # back to vocabulary order
    return logits.masked_fill(drop, NEG_INF)


def top_p_candidates(logits: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor] | None:
    """Top-p on each row's likeliest few alone (TOP_P_FIRST): their logits, -inf past the
    nucleus, and their ids (B, n); None where a row's nucleus lies deeper. A row with top_p >= 1
    keeps only these candidates: the caller samples from none."""
    first = _nucleus_among_first(logits, top_p)
    if first is None:
        return None
    values, ids, mass_before = first
    return values.masked_fill(_past_nucleus(mass_before, top_p), NEG_INF), ids


def _nucleus_among_first(logits: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """The fewest of TOP_P_FIRST that every row's nucleus lies among: their logits, descending,
    their ids, and for each the probability of the tokens ranked above it (B, n); None where no
    such number is below the vocabulary's size."""
    total = None  # each row's log of its sum of exp, over the whole row
    for n in TOP_P_FIRST:
        if n >= logits.shape[-1]:
            return None
        values, ids = top_candidates(logits, n)
        total = logsumexp_rows(logits) if total is None else total
        probs = (values - total).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        if _nucleus_within(mass_before, top_p):
            return values, ids, mass_before
    return None


def _nucleus_within(mass_before: Tensor, top_p: Tensor) -> bool:
    """Every row's nucleus ends among its ranked tokens (its last is already out: so is every
    token after it), or the row keeps all."""
    return bool(((mass_before[:, -1] >= top_p) | (top_p >= 1)).all())


def _past_nucleus(mass_before: Tensor, top_p: Tensor) -> Tensor:
    """(B, n) bool: ranked tokens past each row's nucleus, where top_p < 1; never the first."""
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    return drop


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens with p >= min_p[i] * p_max, -inf elsewhere. logits (B, V).

    In logit space that is l >= l_max + log(min_p): no softmax needed, and min_p = 0 gives a
    threshold of -inf, which keeps everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]  # (B, 1)
    return logits.masked_fill(logits < threshold, NEG_INF)


def draw(
    weights: Tensor,
    generators: Sequence[torch.Generator | None],
    skip: Sequence[bool] | None = None,
) -> Tensor:
    """One index per row of weights (B, N) (>= 0; probabilities, or any multiple of them): j with
    probability weights[i, j] / sum(weights[i]).

    Where the row's running sum first passes one uniform number in [0, sum): one random number
    a row a draw, where a race of exponentials (argmax of p / E, gpt-fast and vLLM) needs N of
    them, and making 262,144 of them and their logarithms took longer than the rest of sampling.
    Row i's number comes from generators[i] alone (None: torch's default generator), so a
    seeded row draws the same tokens whatever else is in the batch. Rows in `skip` draw nothing
    (their index is 0 or any other).
    """
    skip = skip or [False] * len(generators)
    uniform = torch.zeros(len(generators), dtype=torch.float64, device=weights.device)
    if any(g is None and not s for g, s in zip(generators, skip)):
        uniform.uniform_()  # one call for every unseeded row; seeded rows are overwritten next
    for row, (generator, skipped) in enumerate(zip(generators, skip)):
        if generator is not None and not skipped:
            uniform[row : row + 1].uniform_(generator=generator)
    return inverse_cdf(weights, uniform)


def inverse_cdf(weights: Tensor, uniform: Tensor) -> Tensor:
    """For each row of weights (B, N), the index where its running sum first passes uniform[i]
    (in [0, 1), (B,)) times the row's sum: never a token of weight 0.

    A long row (a whole vocabulary) in two steps, so that no running sum runs over all of it:
    the chunk where the sums of its chunks pass that number, then the place within that chunk
    where its own weights pass what is left (the same number's place within the chunk, a
    uniform number in [0, 1) of its own).
    """
    chunks = _chunked(weights, 16)  # 64 chunks or more: a few hundred candidates go in one
    if chunks is None:
        return _pick(weights, uniform)[0]
    rows = torch.arange(len(uniform), device=weights.device)
    # the chunks' sums in float32 (error ~1e-7 of a sum): in float64 torch copied the whole row
    chunk, within = _pick(chunks.sum(dim=-1), uniform)
    return chunk * chunks.shape[-1] + _pick(chunks[rows, chunk], within)[0]


def _pick(weights: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor]:
    """inverse_cdf over whole rows: the index (B,), and where the target lay within its weight
    (B,), in [0, 1)."""
    running = weights.double().cumsum(dim=-1)  # (B, N): float64, so a long tail adds up
    total = running[:, -1:]
    # below the total however u * total rounds: the first sum past it then ends at a weight > 0
    target = torch.minimum(
        uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    chosen = torch.searchsorted(running, target, right=True)
    chosen.clamp_(max=weights.shape[-1] - 1)  # a skipped row's NaN sums stay in range
    weight = weights.gather(1, chosen).double()
    within = 1 - (running.gather(1, chosen) - target) / weight
    return chosen.squeeze(1), within.squeeze(1).clamp_(0.0, 1 - 2**-53).nan_to_num_(0.0)
