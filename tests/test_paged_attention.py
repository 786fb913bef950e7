"""Decode attention over the paged KV pool: the compiled form (block by block, then each row's
blocks merged) and pellucid's kernel (decode_attention.c) equal the eager form (block tables
padded to the longest row, gathered, SDPA), for rows of different lengths, grouped KV heads, a
sliding window and either cache dtype; the explicit causal attention bfloat16 training uses
equals SDPA's; and a step told not to write K/V reads the cache's."""

from __future__ import annotations

import pytest
import torch

from pellucid.engine.model_runner import _decode_batch
from pellucid.models import build_model, kernels, layers
from pellucid.models.context import ForwardContext, PrefillSlice
from pellucid.models.paged_attention import (
    attend_causal,
    attend_causal_explicit,
    attention_mask,
    causal_bias,
    decode_attention,
    decode_attention_bucketed,
    decode_attention_by_block,
    length_buckets,
    padded_mask,
    paged_attention,
)
from pellucid.train.config import TrainConfig

BLOCK = 4


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lens", [[3, 11, 7], [3]])  # [3]: one row in one block
def test_compiled_decode_attention_equals_eager(cache_dtype, window, lens):
    torch.manual_seed(0)
    num_blocks, n_kv, head_dim, n_heads = 12, 2, 16, 6
    k_cache = torch.randn(num_blocks, BLOCK, n_kv, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, BLOCK, n_kv, head_dim).to(cache_dtype)
    tables = [[5], [2, 9, 4], [7, 1]][: len(lens)]  # rows end in different blocks
    batch = _decode_batch(list(range(len(lens))), tables, lens, BLOCK)
    q = torch.randn(len(lens), n_heads, head_dim)  # float32 whatever the cache: as in the model

    eager = decode_attention(
        q, k_cache, v_cache, batch.block_tables, padded_mask(batch, window, BLOCK), 0.25
    )
    compiled = torch.compile(decode_attention_by_block, dynamic=True)(
        q, k_cache, v_cache, batch, window, 0.25
    )
    assert compiled.shape == eager.shape == (len(lens), n_heads, head_dim)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


KERNEL_CASES = [  # (query heads, K/V heads, head dims, rows' context lengths, window)
    (9, 3, 64, [1], None),  # SmolLM2's heads; one key
    (9, 3, 64, [5, 300, 129], None),  # runs of 128 keys: a row ends at a run's first key
    (4, 1, 256, [700, 16], 512),  # Gemma 3's heads and window
    (8, 1, 128, [1000, 513, 128, 129], 100),  # a window shorter than a run
    (16, 2, 64, [2048, 1], None),  # 8 query heads a K/V head, the most the kernel takes
]


@pytest.mark.skipif(not kernels.torch_ops(), reason="no C++ compiler for pellucid's torch ops")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim", "lens", "window"), KERNEL_CASES)
def test_decode_attention_kernel_equals_sdpa(cache_dtype, n_heads, n_kv, head_dim, lens, window):
    torch.manual_seed(0)
    block = 16  # the engine's
    used = [-(-n // block) for n in lens]
    num_blocks = sum(used) + 3
    k_cache = torch.randn(num_blocks, block, n_kv, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block, n_kv, head_dim).to(cache_dtype)
    free = iter(torch.randperm(num_blocks).tolist())  # each row's blocks anywhere in the pool
    tables = torch.zeros(len(lens), max(used), dtype=torch.long)
    for row, n in enumerate(used):
        tables[row, :n] = torch.tensor([next(free) for _ in range(n)])
    ctx_lens = torch.tensor(lens)
    q = torch.randn(len(lens), n_heads, head_dim)
    scale = head_dim**-0.5

    got = torch.ops.pellucid.paged_decode_attention(
        q, k_cache, v_cache, tables, ctx_lens, window or 0, scale
    )
    positions = torch.arange(tables.shape[1] * block)[None]
    mask = attention_mask((ctx_lens - 1)[:, None], positions, window)[:, None]
    want = decode_attention(q, k_cache, v_cache, tables, mask, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


GUESS_CASES = [  # heads, K/V heads, dims, the sequence's first row's length, its rows, window
    (9, 3, 64, 450, 8, None),  # a SmolLM2 reply and 7 guesses
    (9, 3, 64, 126, 5, None),  # guesses past the end of a run of 128 keys
    (4, 1, 256, 510, 4, 512),  # Gemma 3: the rows' windows start at different keys
    (16, 2, 64, 40, 12, None),  # more rows than go together (MAX_ROWS)
]


@pytest.mark.skipif(not kernels.torch_ops(), reason="no C++ compiler for pellucid's torch ops")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim", "first", "rows", "window"), GUESS_CASES)
def test_a_sequences_guesses_attend_together_as_each_row_would_alone(
    cache_dtype, n_heads, n_kv, head_dim, first, rows, window
):
    """A sequence's newest token and its guesses share a block table and see one more key each:
    the kernel attends them together (decode_attention.c). Each row's output is SDPA's, and
    the same bit for bit as when it is attended alone, so a guess does not move its row's
    logits. Another sequence's row follows them in the batch."""
    torch.manual_seed(0)
    block = 16
    used = [-(-(first + rows) // block), 3]
    num_blocks = sum(used) + 3
    k_cache = torch.randn(num_blocks, block, n_kv, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block, n_kv, head_dim).to(cache_dtype)
    free = torch.randperm(num_blocks)
    table, other = free[: used[0]], free[used[0] : sum(used)]
    tables = torch.zeros(rows + 1, used[0], dtype=torch.long)
    tables[:rows] = table
    tables[rows, :3] = other
    ctx_lens = torch.tensor([*range(first, first + rows), 40])
    q = torch.randn(rows + 1, n_heads, head_dim)
    scale = head_dim**-0.5

    def kernel(which: slice) -> torch.Tensor:
        return torch.ops.pellucid.paged_decode_attention(
            q[which], k_cache, v_cache, tables[which], ctx_lens[which], window or 0, scale
        )

    together = kernel(slice(None))
    positions = torch.arange(tables.shape[1] * block)[None]
    mask = attention_mask((ctx_lens - 1)[:, None], positions, window)[:, None]
    want = decode_attention(q, k_cache, v_cache, tables, mask, scale)
    torch.testing.assert_close(together, want, atol=2e-6, rtol=1e-5)
    for b in range(rows + 1):
        assert torch.equal(kernel(slice(b, b + 1))[0], together[b]), f"row {b}"


@pytest.mark.parametrize("window", [None, 5])
def test_rows_of_very_different_lengths_attend_in_groups_as_one_padded_batch(window):
    torch.manual_seed(0)
    num_blocks, n_kv, head_dim, n_heads = 48, 2, 16, 6
    k_cache = torch.randn(num_blocks, BLOCK, n_kv, head_dim)
    v_cache = torch.randn(num_blocks, BLOCK, n_kv, head_dim)
    # a long row (a reply looping at the end of its context) among short ones
    lens = [3, 120, 7, 5, 30]
    tables, free = [], iter(torch.randperm(num_blocks).tolist())
    for n in lens:
        tables.append([next(free) for _ in range(-(-n // BLOCK))])
    batch = _decode_batch(list(range(len(lens))), tables, lens, BLOCK)
    q = torch.randn(len(lens), n_heads, head_dim)
    mask = padded_mask(batch, window, BLOCK)

    padded = decode_attention(q, k_cache, v_cache, batch.block_tables, mask, 0.25)
    grouped = decode_attention_bucketed(q, k_cache, v_cache, batch, mask, 0.25)
    torch.testing.assert_close(grouped, padded, atol=1e-6, rtol=1e-6)
    widths = {w: r.tolist() for r, w in length_buckets(batch, BLOCK)}
    assert widths == {1: [0], 2: [2, 3], 8: [4], 30: [1]}  # the 120-token row alone at full width


@pytest.mark.parametrize("n_kv", [4, 2])  # 2: two query heads share each K/V head
def test_explicit_causal_attention_equals_sdpa(n_kv):
    """The form bfloat16 training uses gives SDPA's outputs and gradients (computed in float32)."""
    torch.manual_seed(0)
    B, H, T, hd = 3, 4, 10, 8
    q = torch.randn(B, H, T, hd, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, n_kv, T, hd, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    grad = torch.randn(B, H, T, hd)

    out = attend_causal_explicit(q, k, v, hd**-0.5, causal_bias(T))
    out.float().backward(grad)
    ours = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attend_causal(q32, k32, v32, hd**-0.5)
    ref.backward(grad)
    assert out.shape == ref.shape == (B, H, T, hd)
    for got, want in zip(ours, [ref, q32.grad, k32.grad, v32.grad], strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # bfloat16 inputs and matmuls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad", [True, False])
def test_only_bfloat16_training_takes_the_explicit_attention(monkeypatch, dtype, grad):
    """A model told to attend explicitly does so for bfloat16 training at its block size only:
    float32 training, inference and other lengths keep SDPA, and so does another model (the
    benchmark's nanoGPT-recipe peer, in the same process)."""
    cfg = TrainConfig(data="-", out="-", n_layers=1).model_config(vocab_size=16)
    model, peer = build_model(cfg), build_model(cfg)
    model.attend_explicitly(8)
    taken = []
    monkeypatch.setattr(layers, "attend_causal_explicit", lambda *a: taken.append(a) or a[0])
    for T in (8, 6):
        q = torch.randn(2, cfg.n_heads, T, cfg.head_dim, dtype=dtype)
        k = v = torch.randn(2, cfg.n_kv_heads, T, cfg.head_dim, dtype=dtype)
        with torch.set_grad_enabled(grad):
            for m in (model, peer):
                m.layers[0].self_attn.attend_within(q, k, v, torch.arange(T))
    assert len(taken) == (1 if dtype == torch.bfloat16 and grad else 0)


def test_a_step_that_writes_no_kv_attends_to_what_the_cache_holds():
    """A trace's pass after the answer (write_kv=False) leaves the pool as the request's own
    steps wrote it, and its queries read those keys and values, not the ones it recomputed."""
    torch.manual_seed(0)
    n_heads, n_kv, head_dim, length = 6, 2, 16, 7
    k_cache = torch.zeros(4, BLOCK, n_kv, head_dim)
    v_cache = torch.zeros(4, BLOCK, n_kv, head_dim)
    table = torch.tensor([2, 0])
    slots = table[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
    q = torch.randn(length, n_heads, head_dim)
    k, v = torch.randn(length, n_kv, head_dim), torch.randn(length, n_kv, head_dim)

    def step(k: torch.Tensor, v: torch.Tensor, write: bool) -> torch.Tensor:
        chunk = PrefillSlice(0, length, length, table)
        ctx = ForwardContext([k_cache], [v_cache], slots, [chunk], None, write_kv=write)
        ctx.capture_attention.add(0)  # as the pass does: attention from the cache
        return paged_attention(q, k, v, 0, ctx, None, 0.25)

    written = step(k, v, True)
    pool = (k_cache.clone(), v_cache.clone())
    again = step(k + 1, v - 1, False)  # other K/V (a recompute rounded otherwise): not used
    assert torch.equal(k_cache, pool[0]) and torch.equal(v_cache, pool[1])
    torch.testing.assert_close(again, written, atol=0, rtol=0)
    assert not torch.equal(step(k + 1, v - 1, True), written)  # had they been written
