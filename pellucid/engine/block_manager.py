"""BlockManager: hands out fixed-size blocks of the KV pool to sequences and shares full blocks
between sequences whose token prefixes are equal (prefix caching).

A full block is known by a chained hash of its tokens and its predecessor's hash, so equal hashes
mean equal prefixes. Freed blocks keep their contents and hash, up to `max_cached` of them: past
that, the least recently freed one forgets its prefix. The pool lies in lazily committed memory
(kv_cache.py), so a block costs RAM from its first write on; blocks are taken from those already
written that cache nothing, then from never-written ones, and only then from the cache. Resident
KV memory is thus bounded by the busiest moment plus the cache's bound, however many requests
pass: without that bound, every new prefix took a fresh block until the whole pool was resident.
Pure bookkeeping: no tensors here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def block_hash(token_ids: tuple[int, ...], parent: int | str | None) -> int:
    """parent: the previous block's hash; for a first block, the sequence's salt (None, or
    the key of the interventions its KV was computed under)."""
    return hash((parent, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_cached: int | None = None,
    ):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # hash -> block id of a full block
        self.prefix_caching = enable_prefix_caching
        # How many free blocks may keep a cached prefix (default: all of them)
        self.max_cached = num_blocks if max_cached is None else max_cached
        # Free blocks, in the order they are taken:
        self.written: list[int] = []  # written before, caching nothing: most recently freed first
        self.fresh: list[int] = list(range(num_blocks - 1, -1, -1))  # never written: pop() = lowest
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.queries = self.hits = 0  # prompt tokens looked up / found in the prefix cache

    @property
    def num_free(self) -> int:
        return len(self.written) + len(self.fresh) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    @property
    def num_written(self) -> int:
        """Blocks written at least once: what the pool holds of physical memory."""
        return len(self.blocks) - len(self.fresh)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate_prefix(
        self,
        token_ids: list[int],
        salt: str | None = None,
        lookup: bool = True,
        multiple: int | None = None,
    ) -> tuple[list[int], int]:
        """Blocks for a new sequence's cached prefix: (block table, tokens already computed).
        Only blocks sealed under the same `salt` match; `lookup=False`: none (a capture must
        compute every position). The prefix taken ends at a multiple of `multiple` tokens (a
        multiple of the block size): the scheduler's pre-fill chunks start only there.

        The block holding the last token is never taken from the cache, so at least one token is
        computed and yields the logits for the next one.
        """
        table: list[int] = []
        parent: int | str | None = salt
        n_full = (len(token_ids) - 1) // self.block_size
        self.queries += n_full * self.block_size
        for i in range(n_full if self.prefix_caching and lookup else 0):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = block_hash(chunk, parent)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            table.append(block_id)
        per = (multiple or self.block_size) // self.block_size  # blocks in a multiple
        del table[len(table) // per * per :]
        for block_id in table:
            self._ref(block_id)
        self.hits += len(table) * self.block_size
        return table, len(table) * self.block_size

    def grow(self, table: list[int], n_tokens: int) -> bool:
        """Append blocks so `table` holds `n_tokens`; False (and nothing taken) if too few free."""
        need = self.blocks_needed(n_tokens) - len(table)
        if need > self.num_free:
            return False
        for _ in range(need):
            table.append(self._take_free())
        return True

    def seal_full_blocks(
        self,
        table: list[int],
        token_ids: list[int],
        n_sealed: int,
        n_computed: int,
        salt: str | None = None,
    ) -> int:
        """Register blocks n_sealed.. that are now full and computed, so later requests with the
        same `salt` can share them; returns the new number of sealed blocks."""
        n_full = n_computed // self.block_size
        if not self.prefix_caching:
            return n_full
        parent = self.blocks[table[n_sealed - 1]].hash if n_sealed else salt
        for i in range(n_sealed, n_full):
            block = self.blocks[table[i]]
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block.hash is None:
                block.hash, block.token_ids = block_hash(chunk, parent), chunk
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
        return n_full

    def free_table(self, table: list[int]) -> None:
        """Release a sequence's blocks; the tail goes first so shared prefixes are freed last."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if self._holds_prefix(block):
                self.cached_free[block_id] = None  # most recently freed: forgotten last
            else:
                self.written.append(block_id)
        table.clear()
        while len(self.cached_free) > self.max_cached:
            block_id, _ = self.cached_free.popitem(last=False)
            self._forget(self.blocks[block_id])
            self.written.append(block_id)

    def _holds_prefix(self, block: Block) -> bool:
        """True if a lookup of its hash finds this block (an equal block may have come first)."""
        return block.hash is not None and self.cached.get(block.hash) == block.block_id

    def _forget(self, block: Block) -> None:
        if self._holds_prefix(block):
            del self.cached[block.hash]
        block.hash, block.token_ids = None, ()

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free[block_id]  # a cached free block comes back into use
        block.ref_count += 1

    def _take_free(self) -> int:
        if self.written:
            block_id = self.written.pop()
        elif self.fresh:
            block_id = self.fresh.pop()
        else:  # the pool is full: the least recently freed prefix makes room
            block_id, _ = self.cached_free.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)  # its old contents are about to be overwritten
        block.ref_count = 1
        return block_id
