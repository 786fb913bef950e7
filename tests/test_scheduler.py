"""Scheduler decisions on stand-in sequences: budgets, chunked pre-fill, FCFS, preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

from pellucid.config import EngineConfig
from pellucid.engine.block_manager import BlockManager
from pellucid.engine.outputs import Timings
from pellucid.engine.scheduler import Scheduler
from pellucid.engine.sequence import Status


@dataclass(eq=False)
class FakeSeq:
    """The fields the scheduler reads and writes, without a model or tokenizer."""

    token_ids: list[int]
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0
    num_sealed_blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    arrival: float = 0.0
    admitted: bool = False
    timings: Timings = field(default_factory=Timings)
    drafter: None = None  # no speculative decoding here (test_speculative.py)
    cache_salt: None = None  # no interventions (test_probes.py)
    capture: None = None

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def step(s: Scheduler, sampled_token: int = 7):
    """schedule -> (pretend the model ran) -> postprocess -> append a token to sampling seqs."""
    batch = s.schedule()
    s.postprocess(batch, seconds=0.0)
    for seq in batch.sampling:
        seq.token_ids.append(sampled_token)
        seq.output_ids.append(sampled_token)
    return [(it.seq, it.n_tokens, it.samples) for it in batch.items]


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    s = make(budget=16)
    seq = FakeSeq(list(range(40)))
    s.add(seq)
    assert step(s) == [(seq, 16, False)]
    assert step(s) == [(seq, 16, False)]
    assert step(s) == [(seq, 8, True)]  # the last chunk yields the first new token
    assert step(s) == [(seq, 1, True)]  # then one token per step


def test_decode_rows_and_prefill_chunks_share_a_step():
    s = make(budget=16)
    a, b = FakeSeq(list(range(5))), FakeSeq(list(range(100, 130)))
    s.add(a)
    step(s)  # a pre-filled
    s.add(b)
    assert step(s) == [(a, 1, True), (b, 15, False)]  # a decodes; b gets the rest of the budget


def test_a_prefill_chunk_that_leaves_part_of_its_prompt_ends_at_a_stretch():
    # so that a prompt's attention takes the same stretches of queries however it is cut
    # (paged_attention.attend_prefill): chunks end at multiples of lcm(32, block size)
    s = make(budget=40)
    seq = FakeSeq(list(range(100)))
    s.add(seq)
    assert [step(s) for _ in range(3)] == [[(seq, 32, False)]] * 2 + [[(seq, 36, True)]]
    # two decode rows leave 38 of the budget: b's chunk ends at 32, then its last 8 follow
    a1, a2, b = FakeSeq([1]), FakeSeq([2]), FakeSeq(list(range(100, 140)))
    s = make(budget=40)
    s.add(a1)
    s.add(a2)
    step(s)
    s.add(b)
    assert step(s) == [(a1, 1, True), (a2, 1, True), (b, 32, False)]
    assert step(s) == [(a1, 1, True), (a2, 1, True), (b, 8, True)]
    # ten decode rows leave 30: b's chunk could not reach 32, so b waits, its blocks handed back
    s = make(budget=40, max_seqs=16)
    rows = [FakeSeq([i]) for i in range(10)]
    for r in rows:
        s.add(r)
    step(s)
    b = FakeSeq(list(range(100, 140)))
    s.add(b)
    assert step(s) == [(r, 1, True) for r in rows]
    assert b.status == Status.WAITING and b.block_table == []


def test_first_come_first_served_and_max_num_seqs():
    s = make(budget=100, max_seqs=2)
    seqs = [FakeSeq([i] * 3) for i in range(3)]
    for q in seqs:
        s.add(q)
    assert [x[0] for x in step(s)] == seqs[:2]
    assert list(s.waiting) == [seqs[2]]


def test_waiting_request_is_not_admitted_without_blocks():
    s = make(num_blocks=3, block_size=4, budget=64)
    a, b = FakeSeq(list(range(10))), FakeSeq(list(range(50, 60)))
    s.add(a)
    s.add(b)
    assert [x[0] for x in step(s)] == [a]  # a takes all 3 blocks; b waits
    assert s.waiting[0] is b and b.block_table == []


def test_preemption_frees_the_newest_and_recomputes_it_later():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = FakeSeq(list(range(7))), FakeSeq(list(range(20, 27)))
    s.add(a)
    s.add(b)
    step(s)  # both pre-filled: 2 blocks each, the pool is full
    step(s)  # both decode position 7, the last slot of their second block
    items = step(s)  # a needs a third block for position 8 -> b, the newest, is preempted
    assert items == [(a, 1, True)]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert s.waiting[0] is b and s.num_preemptions == 1
    s.finish(a)  # a leaves: b comes back and recomputes its prompt and its sampled tokens,
    # all 9: its first block is still in the prefix cache (a's third block took b's second),
    # but a hit counts only up to a multiple of 32 tokens (the scheduler's align)
    assert step(s) == [(b, 9, True)]


def test_prefix_hit_skips_cached_tokens():
    s = make(block_size=4, budget=64)
    a = FakeSeq(list(range(40)))
    s.add(a)
    step(s)
    b = FakeSeq(list(range(36)) + [90, 91, 92])  # 9 blocks shared: a hit of 32 (the align)
    s.add(b)
    items = step(s)
    assert (b, 7, True) in items and b.num_cached == 32
