"""ForwardContext: what one inference step needs from the engine, passed explicitly (no globals).

All tokens of a step (pre-fill chunks of some sequences, one decode token of others) are flattened
into one batch of N rows so every matrix multiply runs once; only attention looks at sequences
separately, reading each one's keys and values from the paged KV cache through its block table.
`model(ids, positions, ctx=None)` is training or a full recompute: no cache at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor


class Probe(Protocol):
    """What some requests of a step look at or change inside the pass (engine/probes.py)."""

    def at(self, site: str, layer: int, x: Tensor) -> Tensor:
        """x (N, ...): the site's tensor for the step's N rows, edited in place as asked."""
        ...


@dataclass(slots=True)
class PrefillSlice:
    """One sequence's pre-fill chunk: rows [start, start + length) of the step's tokens."""

    start: int
    length: int
    ctx_len: int  # tokens in its cache once this chunk is written (earlier chunks + this one)
    block_table: Tensor  # (n_blocks,) int64: where its tokens live in the pool
    # a traced chunk's layers whose queries are kept (ForwardContext.queries); empty: none
    keep_query_layers: frozenset[int] = frozenset()
    # its attention's masks, one per stretch of queries (paged_attention.attend_prefill), by
    # window: made once a step, shared by the layers
    masks: dict[int | None, list[Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeBatch:
    """All sequences that add exactly one token this step, attended in one batched call.

    Two views of where their keys lie: padded block tables (eager attention gathers them), and
    every row's blocks one after another with no padding (compiled attention works block by
    block and then merges each row's blocks, so a short row does not pay for the longest)."""

    rows: Tensor  # (B,) their rows among the step's tokens
    block_tables: Tensor  # (B, max_blocks) int64, padded with block 0 (masked out)
    ctx_lens: Tensor  # (B,) tokens in each cache including the new one
    blocks: Tensor  # (T,) int64: the blocks the B rows use, row after row
    block_rows: Tensor  # (T,) int64: the row each of them belongs to
    block_starts: Tensor  # (T,) int64: the position in its sequence of each block's first slot
    row_blocks: Tensor  # (B, max_blocks) int64: each row's indices into `blocks`, padded with 0
    row_blocks_valid: Tensor  # (B, max_blocks) bool: False where row_blocks is padding
    masks: dict[int | None, Tensor] = field(default_factory=dict)  # by window: (B, 1, 1, max_len)
    # Eager attention's groups of rows of about the same length: (rows, width in blocks)
    buckets: list[tuple[Tensor, int]] | None = None


@dataclass(slots=True)
class ForwardContext:
    k_cache: list[Tensor]  # per layer (num_blocks, block_size, n_kv_heads, head_dim)
    v_cache: list[Tensor]
    slot_mapping: Tensor  # (N,) flat pool slot (block * block_size + offset) of each new token
    prefills: list[PrefillSlice]
    decode: DecodeBatch | None
    # Attention probabilities are kept for these layers (for traces): layer -> one tensor per
    # pre-fill slice (1, heads, length, ctx_len) in `prefills` order, then, if there are decode
    # rows, one (B, heads, 1, max_len) for all of them.
    capture_attention: set[int] = field(default_factory=set)
    attention: dict[int, list[Tensor]] = field(default_factory=dict)
    # layer -> (slice index -> the queries (heads, length, hd) of a slice keeping them, the
    # layer's window and scale): a trace works out their attention probabilities after the step
    # (paged_attention.prefill_probs), so the step itself runs its fused kernels
    queries: dict[int, dict[int, tuple[Tensor, int | None, float]]] = field(default_factory=dict)
    # Rows whose hidden state is kept after every layer (for the logit lens); None: none are.
    capture_hidden_rows: Tensor | None = None
    layer_hidden: list[Tensor] = field(default_factory=list)  # per layer (len(rows), dim)
    # What some requests of the step look at or change inside the pass; None: nothing
    probe: Probe | None = None
    # False: the step's K and V are in the cache already (a trace's pass over positions its
    # request computed): attention reads them there, and the cache keeps what was written first
    write_kv: bool = True


def see(ctx: ForwardContext | None, site: str, layer: int, x: Tensor) -> None:
    """Where the model shows a step's probe a site (engine/probes.py): x (1, N, ...), all the
    step's rows, which the probe may edit in place; nothing happens in a step without one."""
    if ctx is not None and ctx.probe is not None:
        ctx.probe.at(site, layer, x[0])
