"""Decode attention over the paged KV pool: the compiled form (block by block, then each row's
blocks merged) equals the eager form (block tables padded to the longest row, gathered, SDPA),
for rows of different lengths, grouped KV heads, a sliding window and either cache dtype."""

from __future__ import annotations

import pytest
import torch

from pellucid.engine.model_runner import _decode_batch
from pellucid.models.paged_attention import (
    decode_attention,
    decode_attention_by_block,
    padded_mask,
)

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

    eager = decode_attention(q, k_cache, v_cache, batch.block_tables,
                             padded_mask(batch, window, BLOCK), 0.25)
    compiled = torch.compile(decode_attention_by_block, dynamic=True)(q, k_cache, v_cache, batch,
                                                                      window, 0.25)
    assert compiled.shape == eager.shape == (len(lens), n_heads, head_dim)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
