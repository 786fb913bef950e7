"""EngineConfig: how the engine uses memory and schedules work (model hyperparameters live in
models/config.py and come from the checkpoint)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineConfig:
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16  # tokens per KV cache block
    kv_cache_bytes: int = 1 << 30  # the KV pool, preallocated once; sets how many tokens fit
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step: pre-fill chunks + decode rows
    enable_prefix_caching: bool = True
    # Finished requests' KV kept for prefix reuse, at most (the pool commits RAM as it is first
    # written, so this bounds how far a long-running server's memory grows past its busiest moment)
    prefix_cache_bytes: int = 256 << 20
    compile: bool = False  # torch.compile the decode step (engine/compiled_decode.py)
    # ... in a background thread, decoding eagerly until each graph is ready (no step waits)
    compile_in_background: bool = False
    # Use the decode steps compiled ahead of time for this model's architecture, where
    # `pellucid compile` has built them (engine/aot_decode.py): no compiler in this process
    compiled_ahead: bool = True
    # ... and where there are none yet, on the fast path: build them in a background process
    # (engine/aot_build.py), decoding eagerly until they are ready. PELLUCID_BUILD_AHEAD=0: off
    build_ahead: bool = field(default_factory=lambda: os.environ.get("PELLUCID_BUILD_AHEAD") != "0")
    # Speculative decoding from each sequence's own n-grams (engine/drafter.py): on, requests
    # draft where it pays or as their SamplingParams.speculative says; off, none does
    speculative: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise ValueError(
                f"prefix_cache_bytes must be 0 or more, got {self.prefix_cache_bytes!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
