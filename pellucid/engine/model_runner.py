"""ModelRunner: runs the model for a sequence's next step and samples the next token.

Pre-fill pushes the whole prompt through the model in one forward pass (all positions in
parallel); each decode step pushes only the newest token and reads the rest from the KV cache.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from pellucid.engine.kv_cache import KVCache
from pellucid.engine.outputs import TokenLogprob
from pellucid.engine.sampler import SamplerOutput, sample
from pellucid.engine.sequence import Sequence, Status
from pellucid.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, dtype: torch.dtype, max_model_len: int):
        self.model = model
        self.dtype = dtype
        self.max_model_len = max_model_len

    @torch.inference_mode()
    def run(self, seq: Sequence) -> int:
        """Advance `seq` by one token (pre-fill first if needed); return the sampled token id."""
        start = time.perf_counter()
        if seq.status is Status.WAITING:
            logits = self.prefill(seq)
        else:
            logits = self.decode(seq)
        out = sample(logits, [seq.sampler_state])
        token_id = int(out.token_ids[0])
        elapsed = time.perf_counter() - start
        if seq.status is Status.WAITING:
            seq.status, seq.timings.prefill_s = Status.RUNNING, elapsed
        else:
            seq.timings.decode_tokens += 1
            seq.timings.decode_s += elapsed
        if seq.logprobs is not None:
            seq.logprobs.append(_token_logprob(out, token_id, seq.params.logprobs or 0))
        return token_id

    def prefill(self, seq: Sequence) -> Tensor:
        """All prompt tokens in one forward pass; logits of the last position (1, vocab)."""
        max_len = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)
        seq.kv = KVCache(self.model.cfg, max_len, self.dtype)
        ids = torch.tensor([seq.prompt_ids])  # (1, T)
        return self.model(ids, ctx=seq.kv.context(ids.shape[1]), last_only=True)[:, -1]

    def decode(self, seq: Sequence) -> Tensor:
        """One new token attends over the cached keys/values of all earlier ones; (1, vocab)."""
        assert seq.kv is not None
        ids = torch.tensor([[seq.last_token]])  # (1, 1)
        return self.model(ids, ctx=seq.kv.context(1))[:, -1]


def _token_logprob(out: SamplerOutput, token_id: int, n_top: int) -> TokenLogprob:
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs is not None
    top = list(zip(out.top_token_ids[0, :n_top].tolist(), out.top_logprobs[0, :n_top].tolist()))
    return TokenLogprob(token_id, float(out.logprobs[0]), top)
