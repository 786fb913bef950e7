"""Scheduler: decides which sequences run in the next step and how many tokens each pushes.

Every step has a token budget. Running sequences go first (one token each when decoding, the next
chunk when a long prompt is being pre-filled), then waiting ones are admitted first-come
first-served while budget and KV blocks last. A chunk that leaves part of its prompt for later
ends at a multiple of `align` positions, where a prefix-cache hit ends too: a prompt's rows are
then computed the same to the bit however the traffic cut it (see _chunk). When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it is recomputed later.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from pellucid.config import EngineConfig
from pellucid.engine.block_manager import BlockManager
from pellucid.engine.compiled_decode import most_rows
from pellucid.engine.sequence import Sequence, Status
from pellucid.models.paged_attention import PREFILL_STRETCH
from pellucid.models.quant import DENSE_ROWS

# Rows a step may reach with drafts: past the packed layers' few-rows kernel, a step unpacks
# matrices (models/quant.py), and a batch this wide is compute-bound: no guess pays there.
DRAFT_ROWS = DENSE_ROWS
# Except one: a tool call the reply is writing again word for word (Sequence.repeating_block),
# which ends the reply once it closes (engine/block_filter.py). In a batch past DRAFT_ROWS its
# rest is guessed whole, up to REPEAT_DRAFT tokens: checked in one step, the rows cost what
# the steps of one row each would, and the reply ends that many steps sooner. The step stays
# within STEP_ROWS, the most the many-row step compiled ahead takes (engine/aot_decode.py).
REPEAT_DRAFT = 64
STEP_ROWS = most_rows(DRAFT_ROWS + 1)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    n_tokens: int  # tokens pushed through the model this step, drafts included
    samples: bool  # True when this step completes its known tokens, so a new one is sampled
    # guesses at the tokens after its last (engine/drafter.py), pushed after it and checked
    drafts: list[int] = field(default_factory=list)
    # where its tokens start: None, its next position; else a recompute of positions it has
    # (a trace's analysis pass, ModelRunner.analyse)
    start: int | None = None

    @property
    def first(self) -> int:
        """Its first position this step (until the scheduler counts the step)."""
        return self.seq.num_computed if self.start is None else self.start

    @property
    def decodes(self) -> bool:
        """Whether its tokens go in as decode rows, one query each, batched with the others': a
        generated token and its guesses. A prompt's last token alone (the rest was cached)
        stays a pre-fill, rounded as the prompt's other tokens are (see _chunk)."""
        return bool(self.drafts) or (self.n_tokens == 1 and self.first >= len(self.seq.prompt_ids))


@dataclass(slots=True)
class Batch:
    items: list[ScheduledSeq]

    @property
    def sampling(self) -> list[Sequence]:
        return [it.seq for it in self.items if it.samples]


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.block_manager = block_manager
        # where pre-fill chunks and prefix-cache hits end: whole blocks and whole stretches
        self.align = math.lcm(PREFILL_STRETCH, block_manager.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        budget = self.cfg.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        # No guesses beside a pre-fill: its step is bound by arithmetic, where no guess pays,
        # and guesses would take rows from its chunk and move the chunk's bounds, which
        # changes how its prompt is rounded (a greedy reply could change).
        may_draft = not (self.waiting or any(seq.num_pending > 1 for seq in self.running))
        rows = len(self.running)  # in the step, drafts included, once all are scheduled
        i = 0
        while i < len(self.running) and budget > 0:  # running first, oldest first
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:  # its chunk could not end where a stretch does: the next step
                i += 1
                continue
            if not self._make_room(seq, n):
                continue  # seq itself was preempted; running[i] is now the next one
            item = self._item(seq, n)
            if n == 1 and seq.drafter is not None and may_draft:
                repeat = seq.repeating_block  # read once: it compares the reply's calls
                most = min(_draft_room(rows, repeat), budget - 1)
                item.drafts = self._drafts(seq, most, rows, repeat)
                item.n_tokens += len(item.drafts)
                rows += len(item.drafts)
            items.append(item)
            budget -= item.n_tokens
            i += 1
        preempted = self.num_preemptions
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            if self.num_preemptions != preempted:
                break  # memory is short: admit nobody new this step
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted, seq.timings.queued_s = True, time.perf_counter() - seq.arrival
            seq.status = Status.RUNNING
            self.running.append(seq)
            items.append(self._item(seq, n))
            budget -= n
        return Batch(items)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq to compute this step, at most `budget`. A pre-fill chunk that leaves
        part of its prompt for later ends at a multiple of `self.align` (0: it cannot reach
        one), as a prefix-cache hit does: its attention then takes the same stretches of
        queries as the prompt's attended whole (paged_attention.attend_prefill), and the
        prompt comes out the same to the bit, chunked or not, cached or not."""
        n = min(seq.num_pending, budget)
        if n == seq.num_pending or self.cfg.max_num_batched_tokens < self.align:
            return n  # (a step too small to reach a stretch's end takes chunks as they come)
        return max(0, (seq.num_computed + n) // self.align * self.align - seq.num_computed)

    def _item(self, seq: Sequence, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, n, samples=seq.num_computed + n == len(seq.token_ids))

    def _drafts(self, seq: Sequence, most: int, rows: int, repeat: bool) -> list[int]:
        """Guesses at seq's next tokens, at most `most`, within its max_tokens and context, for
        a step of `rows` rows without them; [] where its blocks cannot grow for them without
        taking another's. A repeated block's rest (`repeat`) is always guessed (REPEAT_DRAFT)."""
        if most <= 0:
            return []
        room = min(seq.params.max_tokens - len(seq.output_ids), seq.max_len - len(seq.token_ids))
        assert seq.drafter is not None
        force = seq.params.speculative is True
        since = len(seq.prompt_ids) if repeat else None
        drafts = seq.drafter.propose(seq.token_ids, min(most, room - 1), force, rows, since)
        if drafts and not self.block_manager.grow(
            seq.block_table, seq.num_computed + 1 + len(drafts)
        ):
            return []
        return drafts

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Grow seq's blocks for n more tokens, preempting the newest sequences if needed."""
        while not self.block_manager.grow(seq.block_table, seq.num_computed + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence its cached prefix and blocks; tokens to compute (0: no room)."""
        bm = self.block_manager
        seq.block_table, seq.num_computed = bm.allocate_prefix(
            seq.token_ids,
            seq.cache_salt,
            lookup=seq.capture is None or seq.capture.last_only,
            multiple=self.align,
        )
        if seq.num_cached == 0:
            seq.num_cached = seq.num_computed  # first admission: what the prefix cache saved
        n = self._chunk(seq, budget)
        if n == 0 or not bm.grow(seq.block_table, seq.num_computed + n):
            bm.free_table(seq.block_table)
            seq.num_computed = 0
            return 0
        return n

    def preempt(self, seq: Sequence) -> None:
        """Make room: seq gives up its blocks until it can be readmitted (`requeue`)."""
        self.requeue(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first in line; it recomputes its tokens when readmitted."""
        self.running.remove(seq)
        self.block_manager.free_table(seq.block_table)
        seq.num_computed, seq.num_sealed_blocks = 0, 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, batch: Batch, seconds: float) -> None:
        """After the model ran: count the computed tokens, share newly full blocks, and charge
        the step's time to each sequence (pre-fill until its first token, decode after)."""
        for it in batch.items:
            seq = it.seq
            n = it.n_tokens - len(it.drafts)  # the drafts count once they are taken
            if seq.output_ids and n == 1:
                seq.timings.decode_s += seconds
                seq.timings.decode_tokens += 1
            else:
                seq.timings.prefill_s += seconds
            seq.num_computed += n
            seq.num_sealed_blocks = self.block_manager.seal_full_blocks(
                seq.block_table,
                seq.token_ids,
                seq.num_sealed_blocks,
                seq.num_computed,
                seq.cache_salt,
            )

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks (shared prefixes stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_table(seq.block_table)


def _draft_room(rows: int, repeat: bool) -> int:
    """The guesses a sequence may make in a step of `rows` rows so far: up to DRAFT_ROWS rows,
    and the rest of a repeated block (`repeat`) in a batch already past them (REPEAT_DRAFT)."""
    if rows > DRAFT_ROWS and repeat:
        return min(REPEAT_DRAFT, STEP_ROWS - rows)
    return DRAFT_ROWS - rows
