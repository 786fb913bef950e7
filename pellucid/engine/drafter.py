"""NgramDrafter: guesses of a sequence's next tokens, from the n-grams already in it, for
speculative decoding without a draft model (prompt lookup: HF's `prompt_lookup_num_tokens`,
vLLM's ngram speculator, llama.cpp's lookup decoding).

A reply that copies (a paragraph rewritten with one change, a JSON document re-emitted with an
edit, a tool result quoted) repeats runs of its prompt or of itself. Where the last few tokens
occurred before, the tokens that followed them then are a guess at what follows now. The model
checks every guess in the same forward pass that computes the next token (LLMEngine.step): a
guess it would have produced itself is a token gained for free; the first one it would not
have produced ends the draft, and the token it did produce there takes its place.

The model draws each token exactly as it would without a draft, and a guess is taken only when
it is that token. Under greedy decoding the reply is the same; under sampling, for a guess
that is one fixed token, this is the standard rejection rule (take the guess with probability
p(guess), else draw from p without it), so the distribution of replies is unchanged, and a
seeded request draws the very same tokens.

Where to look: a copy runs forward through its source, so after a draft the drafter keeps its
place there (the cursor) and next looks a few tokens ahead of it for the token just produced:
a copy that re-indents a line or changes a word finds its place again at once. Elsewhere, an
index, n-gram -> where it last continued, extended as tokens arrive, finds the latest earlier
occurrence of the sequence's last few tokens in a few dictionary reads, however long it is.

How much to guess: each guess costs a row of the step. The drafter estimates how often its
guesses are taken, and makes a draft only as long as it promises more tokens per second than
a plain step, for the whole batch: drafting stops on prose it cannot predict and in batches
whose rows fill the step. One case is guessed whatever the estimate and the batch: a tool call
the reply has begun to write again (`repeat_from`, engine/scheduler.py's REPEAT_DRAFT), whole.
"""

from __future__ import annotations

from collections.abc import Sequence

# The n-gram sizes looked up, longest first: a longer match is a surer guess, and a single
# token repeats too often (", the") to guess from.
NGRAM_SIZES = (4, 3, 2)
# Guesses in one draft at most. The step's rows (1 + draft) then stay within the packed
# layers' few-rows kernel (models/quant.py DENSE_ROWS): a step of more rows unpacks matrices.
MAX_DRAFT = 7
# How far past the cursor the token just produced is looked for (a copy's small changes).
CURSOR_WINDOW = 8
# What a decode step costs, in one-row steps at no context: each row beyond the first adds
# ROW_COST to the matrix products (and the LM head), up to FEW_ROWS rows, and WIDE_ROW_COST
# past them; and every sequence's row reads its whole context's keys and values, ATTEND_COST
# a token (fitted to SmolLM2 int4's steps of 1-8 rows at 64-2,048 tokens on an AVX-512 VNNI
# CPU, `benchmarks/step_cost.py`: benchmarks/results/comments.md). A guess's row reads the
# same keys as its sequence's, which the attention kernel converts once for all of them
# (models/decode_attention.c): GUESS_ATTEND of a row's reading (fitted on an AVX2 CPU). So a
# guess costs little in a step of one or two rows, and much of a step of its own in a wide
# batch: drafts pay there only when almost every guess is taken. Fixed rather than measured
# as the engine runs: the same request then drafts the same way every time, whatever a noisy
# neighbour does to one step.
ROW_COST = 0.1
FEW_ROWS = 4
WIDE_ROW_COST = 0.25
ATTEND_COST = 0.0003
GUESS_ATTEND = 0.4
# A draft must promise this much more than a plain step, or it is not made: the cost model's
# errors and a step's noise should not turn a draft at a middling chance into a loss (free
# prose, with guesses taken 28% of the time, drafted at 1.05 and ran at 0.96x).
MARGIN = 1.1
# How fast the estimated chance of a guess being taken follows the latest guesses.
SMOOTHING = 0.2
# After this many steps without a draft (guesses were too often wrong), a one-token draft is
# made to look again, where one would pay at RETRY_CHANCE: what a reply copies changes as it
# goes (prose, then a quoted table).
RETRY_AFTER = 16
RETRY_CHANCE = 0.8


def step_cost(rows: int, context: int, guesses: int = 0) -> float:
    """A decode step of `rows` sequences' rows of about `context` tokens each, and `guesses`
    rows more of one of them, in one-row steps at no context."""
    n = rows + guesses
    few, wide = min(n, FEW_ROWS) - 1, max(n - FEW_ROWS, 0)
    attend = ATTEND_COST * context * (rows + GUESS_ATTEND * guesses)
    return 1 + ROW_COST * few + WIDE_ROW_COST * wide + attend


def best_draft_len(chance: float, most: int, rows: int = 1, context: int = 0) -> int:
    """The number of guesses that makes the step yield the most tokens per second, where each
    is taken with probability `chance` until the first that is not, in a step of `rows` rows
    (of about `context` tokens) besides the guesses; 0 where no draft beats a plain step. A
    draft of k yields 1 + chance + ... + chance^k tokens for its sequence, and slows the step
    (and the other rows' sequences) by k rows."""
    best, best_gain = 0, MARGIN
    expected = 1.0
    plain = step_cost(rows, context)
    for k in range(1, most + 1):
        expected += chance**k
        gain = (rows - 1 + expected) / rows * plain / step_cost(rows, context, k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def longest_match(token_ids: Sequence[int], since: int) -> int | None:
    """The position after the longest run of tokens, at or after `since`, that the sequence's
    last tokens repeat (the latest of equal ones); None where its last token occurs nowhere
    there. A reply writing an earlier tool call again: the run is that call's start, where an
    n-gram of its opening tag would also find the closing tag, which ends in the same tokens."""
    last = len(token_ids) - 1
    best, best_len = None, 0
    for end in range(last - 1, since - 1, -1):
        k = 0
        while k <= end - since and token_ids[end - k] == token_ids[last - k]:
            k += 1
        if k > best_len:
            best, best_len = end + 1, k
    return best


class NgramDrafter:
    """One sequence's place in what it copies, its n-gram index, and its estimate of how often
    its guesses are taken."""

    __slots__ = ("chance", "cursor", "idle_steps", "index", "indexed", "source")

    def __init__(self) -> None:
        # (n-gram) -> the position of the token that followed its latest occurrence
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # token_ids[:indexed] have had their preceding n-grams indexed
        self.chance = 0.5  # estimated probability that a guess is taken
        self.idle_steps = 0  # steps since the last draft
        self.cursor: int | None = None  # the position copied last, where a copy is going on
        self.source: int | None = None  # where the pending draft was copied from

    def propose(
        self,
        token_ids: Sequence[int],
        most: int,
        force: bool = False,
        rows: int = 1,
        repeat_from: int | None = None,
    ) -> list[int]:
        """Up to `most` guesses at the tokens after `token_ids`, for a step of `rows` rows
        without them: as many as pay at the estimated chance (any, with `force`); [] where
        nothing earlier matches. `repeat_from`: the reply (from that position) is writing one
        of its earlier runs again (a tool call): up to `most` guesses, whatever the estimate,
        copied from after the longest earlier run of the reply that its last tokens repeat."""
        self._extend(token_ids)
        self.source = None
        if repeat_from is not None:
            return self._copy(token_ids, longest_match(token_ids, repeat_from), most)
        n = min(most, MAX_DRAFT)
        if not force:
            context = len(token_ids)
            n = best_draft_len(self.chance, n, rows, context)
            if n == 0 and self.idle_steps >= RETRY_AFTER:
                n = best_draft_len(RETRY_CHANCE, min(most, 1), rows, context)
        return self._copy(token_ids, self._copy_point(token_ids) if n > 0 else None, n)

    def _copy(self, token_ids: Sequence[int], start: int | None, n: int) -> list[int]:
        """The n tokens from `start` (fewer where the sequence ends first); [] without one."""
        if start is None or n <= 0:
            self.idle_steps += 1
            self.cursor = None if self.cursor is None else self.cursor + 1
            return []
        self.idle_steps, self.source = 0, start
        return list(token_ids[start : start + n])

    def record(self, taken: int, missed: bool) -> None:
        """How the pending draft went: its first `taken` guesses were the model's own, and the
        one after them was not (`missed`) or was never checked (the reply ended first)."""
        for hit in [True] * taken + [False] * missed:
            self.chance += SMOOTHING * (hit - self.chance)
        if taken and self.source is not None:
            self.cursor = self.source + taken  # the last token stands where guess `taken` did
        elif self.cursor is not None:
            self.cursor += 1  # a first guess refused does not move the copy elsewhere

    def forget(self) -> None:
        """The reply starts over (Sequence.redraw): its tokens leave the index."""
        self.index.clear()
        self.indexed = 0
        self.cursor = self.source = None

    def _copy_point(self, token_ids: Sequence[int]) -> int | None:
        """Where the guesses start: just after the last token's match near the cursor, else
        after the latest earlier occurrence of the last few tokens."""
        last = len(token_ids) - 1
        if self.cursor is not None:
            end = min(self.cursor + CURSOR_WINDOW, last)
            for pos in range(self.cursor, end):
                if token_ids[pos] == token_ids[last]:
                    return pos + 1
        for size in NGRAM_SIZES:
            if last >= size:
                follows = self.index.get(tuple(token_ids[last + 1 - size :]))
                if follows is not None:
                    return follows
        return None

    def _extend(self, token_ids: Sequence[int]) -> None:
        """Index every n-gram that now has a token after it: the tail of the sequence has none
        yet, so a lookup of the tail finds only earlier occurrences."""
        for pos in range(max(self.indexed, 1), len(token_ids)):
            for size in NGRAM_SIZES:
                if pos >= size:
                    self.index[tuple(token_ids[pos - size : pos])] = pos
        self.indexed = len(token_ids)
