"""Decode attention over the paged KV pool: the form inductor compiles (products and sums read
through the block table) equals the eager form (gathered blocks + SDPA), for rows of different
lengths, grouped KV heads, a sliding window and either cache dtype."""

from __future__ import annotations

import pytest
import torch

from pellucid.models.paged_attention import attention_mask, decode_attention


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_compiled_decode_attention_equals_eager(cache_dtype, window):
    torch.manual_seed(0)
    num_blocks, block_size, n_kv, head_dim, n_heads = 12, 4, 2, 16, 6
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(cache_dtype)
    lens = torch.tensor([3, 11, 7])  # rows end in different blocks; the shorter ones padded
    tables = torch.tensor([[5, 0, 0], [2, 9, 4], [7, 1, 0]])
    q = torch.randn(3, n_heads, head_dim)  # float32 whatever the cache: as paged_attention does
    mask = attention_mask((lens - 1)[:, None], torch.arange(3 * block_size)[None], window)[:, None]

    eager = decode_attention(q, k_cache, v_cache, tables, mask, 0.25)
    compiled = torch.compile(decode_attention, dynamic=True)(q, k_cache, v_cache, tables, mask,
                                                             0.25)
    assert compiled.shape == eager.shape == (3, n_heads, head_dim)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
