"""Attention over the paged KV cache: write this step's K/V into their slots, then let each
query attend to its sequence's cached keys and values (gathered through the block table).

Pre-fill chunks are attended one sequence at a time (many queries each), a stretch of
PREFILL_STRETCH positions per call (see attend_prefill); decode rows (one query each) are
attended in one batched call: on the fast path by pellucid's own kernel
(decode_attention.c), which reads each row's keys where they lie; elsewhere eagerly over block
tables padded to a common length, or, compiled, block by block with no padding.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from pellucid.models import kernels
from pellucid.models.config import ModelConfig
from pellucid.models.context import DecodeBatch, ForwardContext, PrefillSlice

# Declared with torch.library's low-level API, as rowdot.py declares its ops (fbgemm.py defines
# the namespace: this is a fragment of it); its CPU implementation is decode_attention.c, which
# ops.cpp wraps.
_LIB = torch.library.Library("pellucid", "FRAGMENT")
_LIB.define(
    "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor ctx_lens, int window, float scale) -> Tensor"
)


@torch.library.register_fake("pellucid::paged_decode_attention")
def _(q: Tensor, *_: object) -> Tensor:
    return torch.empty_like(q)


# Pre-fill queries go to SDPA this many positions at a time, each stretch starting at a multiple
# of it; pre-fill chunks and prefix-cache hits end at such starts (engine/scheduler.py).
PREFILL_STRETCH = 32


def decode_kernel_fits(cfg: ModelConfig) -> bool:
    """Whether decode_attention.c takes this model's heads (whole vectors of 16 dims, at most 8
    query heads a K/V head) and is built here (a C++ compiler and torch's headers)."""
    fits = cfg.head_dim % 16 == 0 and cfg.head_dim <= 256 and cfg.n_heads // cfg.n_kv_heads <= 8
    return fits and kernels.torch_ops()


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Boolean (..., T, S) mask, True where a query may look at a key: causal, maybe windowed."""
    delta = q_pos[..., :, None] - k_pos[..., None, :]  # how far back each key lies
    allowed = delta >= 0
    if window is not None:
        allowed &= delta < window
    return allowed


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, keep: list[Tensor] | None = None
) -> Tensor:
    """softmax(q·kᵀ·scale + mask)·v with grouped KV heads; q (B, H, T, hd), k/v (B, Hkv, S, hd).

    With `keep`, the probabilities are computed explicitly, in float32, and appended to it (for
    traces and captures); otherwise the fused SDPA kernel runs. float32 because bf16 products of
    this shape are an order of magnitude slower on a CPU without native bf16 (AVX2).
    """
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    probs = probabilities(q, k, mask, scale)
    keep.append(probs)
    group = q.shape[1] // k.shape[1]
    return (probs @ v.repeat_interleave(group, dim=1).float()).to(q.dtype)


def probabilities(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q·kᵀ·scale + mask) in float32: q (B, H, T, hd), k (B, Hkv, S, hd) -> (B, H, T, S)."""
    B, H, T = q.shape[:3]
    S = k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1).float().flatten(0, 1)  # (B*H, S, hd)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))  # 0 or -inf
    bias = bias.expand(B, H, T, S).reshape(B * H, T, S)  # a view for a mask shared by heads
    # the mask added by the product itself (its starting sum): no second pass over T x S
    scores = torch.baddbmm(bias, (q.float() * scale).flatten(0, 1), k.transpose(-1, -2))
    return scores.softmax(-1).view(B, H, T, S)


def prefill_probs(ctx: ForwardContext, layer: int, index: int) -> Tensor:
    """The attention probabilities (heads, length, ctx_len) of pre-fill slice `index` at
    `layer`, from the queries the step kept (ForwardContext.queries) and the keys it wrote to
    the cache: what `attend` with `keep` would have found, worked out after the step."""
    s = ctx.prefills[index]
    q, window, scale = ctx.queries[layer][index]  # (H, length, hd)
    keys = slice_cache(ctx.k_cache[layer], s)
    mask = slice_mask(s, window)
    return probabilities(q[None], keys.transpose(0, 1)[None].to(q.dtype), mask, scale)[0]


def attend_prefill(
    q: Tensor, k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor], s: PrefillSlice,
    window: int | None, scale: float,
) -> Tensor:  # fmt: skip
    """A pre-fill chunk's attention: q (length, H, hd), the chunk's own k/v (length, Hkv, hd),
    its layer's (k_cache, v_cache) -> (length, H, hd).

    Its queries are taken a stretch at a time, [lo, hi) with hi the next multiple of
    PREFILL_STRETCH (or the chunk's end), each over the keys of positions [0, hi). Why: SDPA's
    sums for a row depend on the rows of its call (how it tiles them, and how many keys each
    tile reads), so a prompt attended whole, in chunks, or after a cached prefix came out
    different in the last bits, and a greedy reply changed with the traffic beside it. Called
    on the same stretches whatever the chunk, a row comes out the same to the bit. (The cost:
    about even up to 1,024 positions, +13% of attention at 2,048, where SDPA's own causal
    tiling works in bigger tiles: benchmarks/results/comments.md.)"""
    first = s.ctx_len - s.length  # the chunk's first position
    if first == 0:  # nothing cached before it: its own keys (rounded below as the cache holds them)
        keys, values = k, v
    else:
        keys, values = slice_cache(cache[0], s), slice_cache(cache[1], s)  # (ctx_len, Hkv, hd)
    # In the cache's dtype: the fast path's float32 queries are rounded to bf16, as llama.cpp
    # rounds Q to its cache's F16; SDPA took 1.5x as long in float32 (comments.md)
    dtype = cache[0].dtype
    keys, values = keys.transpose(0, 1).to(dtype), values.transpose(0, 1).to(dtype)
    queries = q.transpose(0, 1).to(dtype)  # (H, length, hd)
    out = torch.empty_like(queries)
    spans = stretches(first, s.ctx_len)
    if window not in s.masks:
        s.masks[window] = [
            attention_mask(torch.arange(lo, hi), torch.arange(hi), window) for lo, hi in spans
        ]
    for (lo, hi), mask in zip(spans, s.masks[window]):
        out[:, lo - first : hi - first] = F.scaled_dot_product_attention(
            queries[None, :, lo - first : hi - first],
            keys[None, :, :hi],
            values[None, :, :hi],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )[0]
    return out.transpose(0, 1).to(q.dtype)


def stretches(first: int, end: int) -> list[tuple[int, int]]:
    """Positions [first, end) cut at the multiples of PREFILL_STRETCH: [(lo, hi), ...]."""
    cuts = range((first // PREFILL_STRETCH + 1) * PREFILL_STRETCH, end, PREFILL_STRETCH)
    return list(itertools.pairwise([first, *cuts, end]))


def slice_cache(cache: Tensor, s: PrefillSlice) -> Tensor:
    """A pre-fill chunk's sequence's keys or values, (ctx_len, Hkv, hd), from the pool."""
    return cache.index_select(0, s.block_table).flatten(0, 1)[: s.ctx_len]


def slice_mask(s: PrefillSlice, window: int | None) -> Tensor:
    """(length, ctx_len): which of its sequence's keys each of a chunk's queries sees."""
    k_pos = torch.arange(s.ctx_len)
    return attention_mask(k_pos[s.ctx_len - s.length :], k_pos, window)


def attend_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(q·kᵀ·scale)·v where every query sees the keys up to its own position, for q and
    k/v over the same T tokens in order: q (B, H, T, hd), k/v (B, Hkv, T, hd). The kernel's own
    is_causal triangle, with no mask tensor to build and add."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def causal_bias(T: int, device: torch.device | None = None) -> Tensor:
    """The (T, T) additive causal mask: 0 on and below the diagonal, -inf above."""
    return torch.full((T, T), float("-inf"), device=device).triu(1)


def attend_causal_explicit(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor) -> Tensor:
    """attend_causal written out, for training in bfloat16 on CPU: scores (B, Hkv, group, T, T) in
    float32 plus the stored (T, T) causal bias, softmax, then the values. SDPA's flash kernel has
    no fast bfloat16 backward on CPU, and its math path, compiled, rebuilds the causal triangle
    from indices for every score, which a stored mask, added, avoids (a quarter of a compiled
    forward+backward at nanoGPT's baby size: benchmarks/results/comments.md). The scores are
    materialized, so this suits short blocks: the trainer opts in (LlamaModel.attend_explicitly)
    for its block size."""
    B, H, T, hd = q.shape
    Hkv = k.shape[1]
    q = q.unflatten(1, (Hkv, H // Hkv))  # the query heads that share each K/V head, side by side
    k, v = k[:, :, None], v[:, :, None]  # (B, Hkv, 1, T, hd): broadcast over the group
    scores = (q @ k.transpose(-1, -2)).float() * scale + bias
    return (scores.softmax(-1).to(v.dtype) @ v).view(B, H, T, hd)


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: int,
    ctx: ForwardContext,
    window: int | None,
    scale: float,
    kernel: bool = False,
) -> Tensor:
    """q (N, H, hd), k/v (N, Hkv, hd) for the step's N tokens -> attention output (N, H, hd).
    `kernel`: decode rows by decode_attention.c (see decode_kernel_fits), unless traced."""
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    n_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    if ctx.write_kv:
        k_cache.view(-1, n_kv, head_dim).index_copy_(0, ctx.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, n_kv, head_dim).index_copy_(0, ctx.slot_mapping, v.to(v_cache.dtype))
    keep = ctx.attention.setdefault(layer, []) if layer in ctx.capture_attention else None
    out = torch.empty_like(q)
    for i, s in enumerate(ctx.prefills):
        rows = slice(s.start, s.start + s.length)
        if layer in s.keep_query_layers:
            ctx.queries.setdefault(layer, {})[i] = (q[rows].transpose(0, 1), window, scale)
        if keep is None:
            out[rows] = attend_prefill(
                q[rows], k[rows], v[rows], (k_cache, v_cache), s, window, scale
            )
            continue
        keys, values = slice_cache(k_cache, s), slice_cache(v_cache, s)  # (S, Hkv, hd)
        mask = slice_mask(s, window)
        o = attend(
            q[rows].transpose(0, 1)[None],
            keys.transpose(0, 1)[None].to(q.dtype),
            values.transpose(0, 1)[None].to(q.dtype),
            mask,
            scale,
            keep,
        )
        out[rows] = o[0].transpose(0, 1)
    if ctx.decode is not None:
        d = ctx.decode
        queries = q if not ctx.prefills else q[d.rows]  # without pre-fills: all rows, in order
        # In float32 whatever the cache holds: SDPA on CPU is much slower for one query against
        # many bf16 keys than in float32.
        queries = queries.float()
        if kernel and keep is None:
            o = torch.ops.pellucid.paged_decode_attention(
                queries, k_cache, v_cache, d.block_tables, d.ctx_lens, window or 0, scale
            )
        elif torch.compiler.is_compiling() and keep is None:
            o = decode_attention_by_block(queries, k_cache, v_cache, d, window, scale)
        else:
            mask = padded_mask(d, window, k_cache.shape[1])
            if keep is not None:  # a traced step: the probabilities are kept: no fused kernel
                keys = gather_blocks(k_cache, d.block_tables).float()
                values = gather_blocks(v_cache, d.block_tables).float()
                o = attend(queries[:, :, None], keys, values, mask, scale, keep)[:, :, 0]
            else:
                o = decode_attention_bucketed(queries, k_cache, v_cache, d, mask, scale)
        o = o.to(q.dtype)  # (B, H, hd)
        if not ctx.prefills:
            return o
        out[d.rows] = o
    return out


def padded_mask(d: DecodeBatch, window: int | None, block_size: int) -> Tensor:
    """(B, 1, 1, max_len) bool over the padded block tables; the same for every layer with this
    window, so made once a step. Causality also hides the padding: every padded slot lies
    after the query's position."""
    if window not in d.masks:
        max_len = d.block_tables.shape[1] * block_size
        d.masks[window] = attention_mask(
            (d.ctx_lens - 1)[:, None], torch.arange(max_len)[None], window
        )[:, None]
    return d.masks[window]


def gather_blocks(cache: Tensor, block_tables: Tensor) -> Tensor:
    """(num_blocks, block_size, Hkv, hd) pool, (B, n) block tables -> (B, Hkv, n*block_size, hd)."""
    B, n = block_tables.shape
    # index_select of whole blocks: on CPU much faster than advanced indexing with the 2-D table
    blocks = cache.index_select(0, block_tables.flatten())
    return blocks.view(B, n * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, mask: Tensor, scale: float
) -> Tensor:
    """One query per sequence, q (B, H, hd) -> (B, H, hd) in q's dtype (float32 here, whatever
    the cache's): gather each sequence's keys and values through its block table, then the
    fused SDPA kernel."""
    keys = gather_blocks(k_cache, block_tables).to(q.dtype)
    values = gather_blocks(v_cache, block_tables).to(q.dtype)
    B, H, hd = q.shape
    # GQA with one token: the queries sharing a KV head are that head's "query rows". (With
    # enable_gqa instead, the compiled decode step ran 30% slower at 512 tokens of context.)
    grouped = q.view(B, keys.shape[1], H // keys.shape[1], hd)
    o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(B, H, hd)


def decode_attention_bucketed(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, d: DecodeBatch, mask: Tensor, scale: float
) -> Tensor:
    """decode_attention for rows of very different lengths, q (B, H, hd) -> (B, H, hd): one
    padded gather makes every row read as many keys as the longest (a tool call looping at 8k
    tokens made 15 short rows each read 8k: ~0.5 s a step), so rows go in groups of about the
    same length, each gathered only as wide as its longest row."""
    block_size = k_cache.shape[1]
    buckets = length_buckets(d, block_size)
    if len(buckets) == 1:
        return decode_attention(q, k_cache, v_cache, d.block_tables, mask, scale)
    out = torch.empty_like(q)
    for rows, width in buckets:
        out[rows] = decode_attention(
            q[rows],
            k_cache,
            v_cache,
            d.block_tables[rows, :width],
            mask[rows, ..., : width * block_size],
            scale,
        )
    return out


def length_buckets(d: DecodeBatch, block_size: int) -> list[tuple[Tensor, int]]:
    """The rows grouped by the blocks they use, rounded up to a power of two: [(rows, width)].
    A group reads at most twice its rows' keys, in at most log2(longest) calls; made once a
    step, for every layer."""
    if d.buckets is None:
        used = ((d.ctx_lens + block_size - 1) // block_size).tolist()
        most = d.block_tables.shape[1]
        groups: dict[int, list[int]] = {}
        for row, n in enumerate(used):
            groups.setdefault(min(1 << (n - 1).bit_length(), most), []).append(row)
        d.buckets = [(torch.tensor(rows), width) for width, rows in sorted(groups.items())]
    return d.buckets


def decode_attention_by_block(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, d: DecodeBatch, window: int | None, scale: float
) -> Tensor:
    """decode_attention for inductor, q (B, H, hd) float32 -> (B, H, hd), in two stages.

    1. Each block any row uses is attended by that row's query on its own (T blocks, no padding
       between rows): the block's highest score m, its sum of exp(score - m), and its
       exp-weighted values. Written as plain products and sums, inductor turns this into loops
       that read keys and values where they lie in the pool, with no gathered copy.
    2. Each row merges its blocks' results, rescaled to the row's highest score (the merge of
       flash-decoding). Only this stage is padded to the longest row, and it is per block, not
       per token.
    For 32 rows of 20-384 tokens this takes half the time of attending the padded tables (the
    work follows the tokens there are); for one row, the same.
    """
    B, H, hd = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    positions = d.block_starts[:, None] + torch.arange(block_size)  # (T, bs)
    allowed = attention_mask((d.ctx_lens[d.block_rows] - 1)[:, None], positions, window)[:, 0]
    keys = k_cache[d.blocks].transpose(1, 2)[:, :, None]  # (T, Hkv, 1, bs, hd)
    values = v_cache[d.blocks].transpose(1, 2)[:, :, None]
    queries = q.view(B, n_kv, H // n_kv, 1, hd)[d.block_rows]  # (T, Hkv, G, 1, hd)
    scores = (keys.to(q.dtype) * queries).sum(-1) * scale  # (T, Hkv, G, bs)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    high = scores.amax(-1)  # (T, Hkv, G); -inf for a block the window hides entirely
    weights = torch.exp(scores - high.clamp(min=-1e30)[..., None])  # such a block: all 0
    total = weights.sum(-1)
    out = (weights[..., None] * values.to(q.dtype)).sum(-2)  # (T, Hkv, G, hd)

    # (B, n, Hkv, G): each row's blocks; padding and hidden blocks weigh exp(-inf) = 0
    row_high = high[d.row_blocks].masked_fill(~d.row_blocks_valid[:, :, None, None], float("-inf"))
    rescale = torch.exp(row_high - row_high.amax(1, keepdim=True))
    row_total = (total[d.row_blocks] * rescale).sum(1)  # (B, Hkv, G)
    row_out = (out[d.row_blocks] * rescale[..., None]).sum(1)  # (B, Hkv, G, hd)
    return (row_out / row_total[..., None]).view(B, H, hd)
