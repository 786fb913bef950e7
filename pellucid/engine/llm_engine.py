"""LLMEngine: accepts requests and advances all of them together, one `step()` at a time.
A step:

    batch = scheduler.schedule()               # who runs: pre-fill chunks, decode rows, drafts
    result = model_runner.run(batch)           # one forward pass for all of them, then sampling
    scheduler.postprocess(batch, seconds)      # computed tokens, prefix-cache sharing, time
    seq.append(token) -> RequestOutput         # stop checks, text deltas; finished ones free blocks
    take_drafts(seq, ...)                      # each guess the model agrees with: one more token

One thread steps at a time: whoever drives the engine (LLM's loops, the server's engine thread)
holds `lock`. A request added with `on_output` gets its outputs through it, whichever thread ran
the step, so an LLM call on a served model never swallows a server request's tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from pellucid.config import EngineConfig
from pellucid.engine.block_manager import BlockManager
from pellucid.engine.drafter import NgramDrafter
from pellucid.engine.grammar import GrammarCompiler
from pellucid.engine.kv_cache import KVCachePool
from pellucid.engine.model_runner import ModelRunner
from pellucid.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from pellucid.engine.probes import Capture
from pellucid.engine.sampler import sample
from pellucid.engine.sampling_params import SamplingParams
from pellucid.engine.scheduler import Scheduler
from pellucid.engine.sequence import Sequence, Status
from pellucid.engine.trace_hooks import end_step
from pellucid.engine.trace_recorder import Recorder
from pellucid.errors import PromptError
from pellucid.models.llama import LlamaModel
from pellucid.tokenizer import Tokenizer


class LLMEngine:
    def __init__(
        self, model: LlamaModel, tokenizer: Tokenizer, kv_dtype: torch.dtype, config: EngineConfig
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        cfg = model.cfg
        num_blocks = KVCachePool.blocks_for_budget(
            cfg, config.kv_cache_bytes, config.block_size, kv_dtype
        )
        self.pool = KVCachePool(cfg, num_blocks, config.block_size, kv_dtype)
        # One sequence must always fit in the pool, or it could never be scheduled.
        self.max_model_len = min(
            config.max_model_len or cfg.context_length,
            cfg.context_length,
            self.pool.capacity_tokens,
        )
        model.use_context(self.max_model_len)  # LongRoPE's frequencies depend on it
        block_bytes = self.pool.bytes_per_token * config.block_size
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            max_cached=config.prefix_cache_bytes // block_bytes,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.model_runner = ModelRunner(
            model, self.pool, config.compile, config.compile_in_background, config.compiled_ahead
        )
        self.sequences: dict[int, Sequence] = {}
        self.grammars = GrammarCompiler(tokenizer)
        # Re-entrant: an LLM call made while holding it (a test borrowing a served engine) runs.
        self.lock = threading.RLock()

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None] | None = None,
        capture: Capture | None = None,
    ) -> Sequence:
        """Queue a request; `on_output`, when given, receives each of its outputs as well;
        `capture`, when given, keeps the prompt's named activations (LLM.run_with_cache)."""
        self.check_prompt(prompt_ids)
        for iv in params.interventions:
            iv.check(self.model.cfg, self.max_model_len)
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        seq = Sequence(
            prompt_ids, params, self.tokenizer, self.model.cfg.vocab_size, self.max_model_len
        )
        if matcher is not None:
            seq.sampler_state.matcher, seq.sampler_state.grammars = matcher, self.grammars
        options = params.trace_options
        if options is not None:
            seq.trace = Recorder(options, params, prompt_ids, self.tokenizer, self.model, self.pool)
        seq.on_output = on_output
        seq.capture = capture
        if self.config.speculative and params.speculative is not False:
            seq.drafter = NgramDrafter()
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty: give at least one token of text")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds "
                f"{self.max_model_len}, and at least one must be left to generate: "
                "shorten the prompt or raise max_model_len"
            )
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence; one output per sequence that got a new token.
        The caller holds `lock` (or is the only thread using the engine)."""
        batch = self.scheduler.schedule()
        result = self.model_runner.run(batch)
        self.scheduler.postprocess(batch, result.seconds)
        end_step(batch, result.seconds)  # traced requests note the step
        outputs = []
        drafted = [it.drafts for it in batch.items if it.samples]
        sampled = zip(batch.sampling, result.token_ids, result.logprobs, strict=True)
        for (seq, token_id, logprob), drafts, rows in zip(sampled, drafted, result.draft_logits):
            outputs.append(self._append(seq, token_id, logprob))
            if drafts:
                outputs += self.take_drafts(seq, drafts, rows, token_id)
        return outputs

    def take_drafts(
        self, seq: Sequence, drafts: list[int], logits: Tensor, token_id: int
    ) -> list[RequestOutput]:
        """Check seq's guesses, in order, against what the model draws at each (one output per
        token gained). `logits` (len(drafts), V): row j is the model's prediction after guess j,
        and it counts only if guess j was the token just drawn; the first guess that was not
        ends the check, and the K/V written for it and the guesses after it are left to be
        overwritten. Each draw applies the sequence's sampler exactly as a plain step would."""
        outputs: list[RequestOutput] = []
        missed = False
        for row, guess in enumerate(drafts):
            if seq.status is not Status.RUNNING:
                break  # it finished (or starts over) before this guess: unchecked
            if token_id != guess:
                missed = True
                break
            seq.num_computed += 1  # the guess's K/V, written this step, is now its own
            seq.timings.decode_tokens += 1
            out = sample(logits[row : row + 1], [seq.sampler_state])
            token_id = int(out.token_ids[0])
            if seq.trace is not None:
                seq.trace.keep_drafted_token(logits[row], token_id, seq.sampler_state)
            n_top = seq.params.logprobs
            logprob = None if n_top is None else out.token_logprob(0, n_top)
            outputs.append(self._append(seq, token_id, logprob))
        seq.timings.draft_tokens += len(drafts)
        seq.timings.accepted_tokens += len(outputs)
        assert seq.drafter is not None
        seq.drafter.record(len(outputs), missed)
        if seq.trace is not None:
            seq.trace.note_draft(drafts, len(outputs))
        return outputs

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        """The sampled token joins its sequence; a finished sequence frees its blocks."""
        delta = seq.append(token_id)
        if seq.is_finished:
            if seq.trace is not None:
                self._analyse(seq)  # before its blocks go: they hold its K/V
            self._release(seq)
        elif seq.redraw_due:
            self.scheduler.requeue(seq)  # frees its blocks; it pre-fills again, from the cache
            seq.redraw()
        out = seq.output(delta, logprob)
        if seq.on_output is not None:
            seq.on_output(out)
        return out

    def _analyse(self, seq: Sequence) -> None:
        """A finished traced request's attention and logit lens, if its trace asks for them,
        at the positions its pre-fill did not keep in flight (its decode steps', a prefix-cache
        hit's): one pass over them (ModelRunner.analyse), timed on the trace."""
        rec = seq.trace
        assert rec is not None
        if not rec.wants_pass:
            return
        start = time.perf_counter()
        spans = rec.missing(seq.num_computed)
        for first, n, attention, hidden in self.model_runner.analyse(seq, spans):
            rec.keep_pass(first, n, attention, hidden)
        rec.end_pass(time.perf_counter() - start)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.sequences.pop(seq.request_id, None)

    def abort(self, request_id: int) -> None:
        seq = self.sequences.get(request_id)
        if seq is not None and not seq.is_finished:
            seq.finish("abort")
            self._release(seq)

    def abort_queued_longer_than(self, seconds: float) -> list[int]:
        """Abort the sequences that have waited `seconds` without being run once; their ids."""
        now = time.perf_counter()
        expired = [
            s.request_id
            for s in self.scheduler.waiting
            if not s.admitted and now - s.arrival > seconds
        ]
        for request_id in expired:
            self.abort(request_id)
        return expired

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_used_tokens=bm.num_used * bm.block_size,
            kv_capacity_tokens=self.pool.capacity_tokens,
            kv_cached_tokens=len(bm.cached_free) * bm.block_size,
            kv_resident_tokens=bm.num_written * bm.block_size,
            prefix_cache_queries=bm.queries,
            prefix_cache_hits=bm.hits,
        )
