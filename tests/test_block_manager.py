"""BlockManager bookkeeping: allocation, growth, prefix hits by chained hashes, LRU reuse."""

from __future__ import annotations

from pellucid.engine.block_manager import BlockManager


def admit(bm: BlockManager, tokens: list[int]) -> tuple[list[int], int]:
    """What the scheduler does for a new sequence: cached prefix, then blocks for the rest."""
    table, cached = bm.allocate_prefix(tokens)
    assert bm.grow(table, len(tokens))
    return table, cached


def compute(bm: BlockManager, table: list[int], tokens: list[int]) -> None:
    bm.seal_full_blocks(table, tokens, 0, len(tokens))


def test_grow_takes_whole_blocks_and_refuses_when_full():
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    assert bm.grow(table, 5) and len(table) == 2 and bm.num_free == 2
    assert bm.grow(table, 8) and len(table) == 2  # still fits
    assert not bm.grow(table, 17) and len(table) == 2  # would need 5 blocks: nothing taken
    bm.free_table(table)
    assert bm.num_free == 4 and table == []


def test_shared_prefix_is_reused_by_reference():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(10))  # blocks [0-3] [4-7] [8-9]
    table_a, cached = admit(bm, a)
    assert cached == 0
    compute(bm, table_a, a)
    b = list(range(8)) + [99, 98, 97]  # same first two blocks
    table_b, cached = admit(bm, b)
    assert cached == 8 and table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert bm.blocks[table_a[0]].ref_count == 2
    assert (bm.queries, bm.hits) == (8 + 8, 8)


def test_last_token_block_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(8))
    table_a, _ = admit(bm, a)
    compute(bm, table_a, a)
    _, cached = admit(bm, list(a))  # identical prompt: the final block is recomputed
    assert cached == 4


def test_different_earlier_block_breaks_the_chain():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(12))
    table_a, _ = admit(bm, a)
    compute(bm, table_a, a)
    b = [50] + list(range(1, 12)) + [7]  # block 0 differs, block 1 equal in content
    _, cached = admit(bm, b)
    assert cached == 0  # chained hashes: equal later blocks after a different one do not match


def test_freed_blocks_stay_cached_until_reused_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = list(range(9))
    table_a, _ = admit(bm, a)  # 3 blocks
    compute(bm, table_a, a)
    bm.free_table(table_a)
    assert bm.num_used == 0
    _, cached = admit(bm, list(range(8)) + [5])  # after the owner left, the prefix still hits
    assert cached == 8


def test_reused_block_loses_its_old_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = list(range(5))
    table_a, _ = admit(bm, a)
    compute(bm, table_a, a)
    bm.free_table(table_a)
    other = [40, 41, 42, 43, 44, 45, 46, 47]
    table, cached = bm.allocate_prefix(other)
    assert cached == 0 and bm.grow(table, 8)  # both blocks overwritten
    bm.free_table(table)
    _, cached = bm.allocate_prefix(a)
    assert cached == 0  # the old prefix is gone, not wrongly matched


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = list(range(10))
    table_a, _ = admit(bm, a)
    compute(bm, table_a, a)
    _, cached = admit(bm, list(a))
    assert cached == 0


def test_blocks_that_cache_nothing_are_reused_before_fresh_ones():
    bm = BlockManager(num_blocks=8, block_size=4)
    for _ in range(20):  # prompts too short to fill a block: nothing to cache
        table, _ = admit(bm, [1, 2, 3])
        bm.free_table(table)
    assert bm.num_written == 1


def test_cached_prefixes_are_bounded_and_resident_blocks_level_off():
    bm = BlockManager(num_blocks=64, block_size=4, max_cached=5)
    for i in range(40):  # every request a new 2-block prefix: each would be cached for good
        tokens = [1000 + i] * 8 + [7]
        table, _ = admit(bm, tokens)
        compute(bm, table, tokens)
        bm.free_table(table)
        assert len(bm.cached_free) <= 5
    # the busiest moment held 3 blocks; past it only the 5 cached ones were ever added
    assert bm.num_written <= 3 + 5
    _, cached = admit(bm, [1000 + 39] * 8 + [8])  # the newest prefix is still there
    assert cached == 8
    _, cached = admit(bm, [1000] * 8 + [8])  # the oldest was forgotten
    assert cached == 0


def test_a_full_pool_takes_cached_blocks_least_recently_freed_first():
    bm = BlockManager(num_blocks=3, block_size=4)  # cache bound: the whole pool
    old, new = [1] * 4 + [9], [2] * 4 + [9]  # one full block each, and one partial
    for tokens in (old, new):
        table, _ = admit(bm, tokens)
        compute(bm, table, tokens)
        bm.free_table(table)
    assert len(bm.cached_free) == 2 and len(bm.written) == 1 and not bm.fresh
    table: list[int] = []
    assert bm.grow(table, 2 * 4)  # the uncached block, then the oldest cached one
    _, cached = bm.allocate_prefix(new)
    assert cached == 4
    _, cached = bm.allocate_prefix(old)
    assert cached == 0


def test_no_prefix_cache_keeps_nothing():
    bm = BlockManager(num_blocks=16, block_size=4, max_cached=0)
    a = list(range(9))
    table, _ = admit(bm, a)
    compute(bm, table, a)
    bm.free_table(table)
    assert not bm.cached_free and bm.num_free == 16
    _, cached = admit(bm, list(a))
    assert cached == 0


def test_a_salt_keeps_prefixes_apart_and_lookup_off_reads_none():
    """KV computed under interventions is sealed under their key: only the same key finds it."""
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(10))
    table, _ = bm.allocate_prefix(tokens, salt="ablate")
    assert bm.grow(table, len(tokens))
    bm.seal_full_blocks(table, tokens, 0, len(tokens), salt="ablate")
    assert bm.allocate_prefix(tokens)[1] == 0  # plain: no hit
    assert bm.allocate_prefix(tokens, salt="steer")[1] == 0
    same, cached = bm.allocate_prefix(tokens, salt="ablate")
    assert cached == 8 and same == table[:2]
    assert bm.allocate_prefix(tokens, salt="ablate", lookup=False)[1] == 0


def test_a_prefix_hit_ends_at_a_multiple_it_is_given():
    # the scheduler's pre-fill chunks start at multiples of its `align`: a hit stops at one
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(14))
    table_a, _ = admit(bm, a)
    compute(bm, table_a, a)  # three full blocks sealed
    table, cached = bm.allocate_prefix(a + [99], multiple=8)
    assert cached == 8 and table == table_a[:2] and bm.hits == 8
    assert bm.blocks[table_a[2]].ref_count == 1  # the third block was not taken
    assert bm.allocate_prefix(a + [99])[1] == 12  # block by block: all three
