"""LLMEngine: accepts requests and advances all of them one token per `step()`.

This is the foundation's engine: each running sequence has its own contiguous KV cache and
steps one after another. The scheduler, paged cache and batched steps replace that loop later;
`add_request` / `step` / `abort` stay as they are.
"""

from __future__ import annotations

import torch

from pellucid.engine.model_runner import ModelRunner
from pellucid.engine.outputs import EngineStats, RequestOutput
from pellucid.engine.sampling_params import SamplingParams
from pellucid.engine.sequence import Sequence, Status
from pellucid.errors import PromptError
from pellucid.models.llama import LlamaModel
from pellucid.tokenizer import Tokenizer


class LLMEngine:
    def __init__(
        self, model: LlamaModel, tokenizer: Tokenizer, dtype: torch.dtype, max_model_len: int
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_runner = ModelRunner(model, dtype, max_model_len)
        self.running: list[Sequence] = []

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_prompt(prompt_ids)
        seq = Sequence(
            prompt_ids, params, self.tokenizer, self.model.cfg.vocab_size, self.max_model_len
        )
        self.running.append(seq)
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
        outputs = []
        for seq in self.running:
            token_id = self.model_runner.run(seq)
            delta = seq.append(token_id)
            outputs.append(seq.output(delta))
        self.running = [s for s in self.running if not s.is_finished]
        return outputs

    def abort(self, request_id: int) -> None:
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish("abort")
        self.running = [s for s in self.running if not s.is_finished]

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def stats(self) -> EngineStats:
        caches = [s.kv for s in self.running if s.kv is not None]
        return EngineStats(
            running=sum(s.status is Status.RUNNING for s in self.running),
            waiting=sum(s.status is Status.WAITING for s in self.running),
            kv_used_tokens=sum(c.length for c in caches),
            kv_capacity_tokens=sum(c.max_len for c in caches),
        )
