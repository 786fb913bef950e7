"""ForwardContext: what one forward pass needs from the engine, passed explicitly (no globals).

`model(ids, positions, ctx)` with `ctx=None` is training or a full recompute: attention sees only
this call's tokens. With a context, each layer appends its keys and values to the KV cache and
attends over everything cached so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(slots=True)
class ForwardContext:
    k_cache: list[Tensor]  # per layer, (B, max_len, n_kv_heads, head_dim)
    v_cache: list[Tensor]
    start: int  # tokens already in the cache; this call's tokens go to [start, start + T)
    # Per-layer attention probabilities are kept here for these layers (for `explain`).
    capture_attention: set[int] = field(default_factory=set)
    attention: dict[int, Tensor] = field(default_factory=dict)  # layer -> (B, n_heads, T, S)

    def store(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this call's k, v (B, T, n_kv, hd) into the cache; return all cached (B, S, ...)."""
        end = self.start + k.shape[1]
        self.k_cache[layer][:, self.start : end] = k
        self.v_cache[layer][:, self.start : end] = v
        return self.k_cache[layer][:, :end], self.v_cache[layer][:, :end]
