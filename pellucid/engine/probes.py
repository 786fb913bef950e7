"""Probes: looking inside one inference forward pass, and changing it, for some requests only.

A request may carry interventions (`SamplingParams.interventions`) and a capture of named
activations (`LLM.run_with_cache`). A step flattens every request's tokens into one row, so the
step's `Probe` knows which rows are whose, at which positions; the model hands it the tensor at a
few named sites (`probe.at(site, layer, x)`) and the probe edits or keeps those rows only, so the
other requests of the batch are untouched. A step without a probe pays one `is None` per site.

Hook names (TransformerLens's; T is the text's tokens, and there is no batch axis):

| name                           | shape            | holds                                   |
| ------------------------------ | ---------------- | --------------------------------------- |
| `blocks.{L}.hook_resid_pre`    | (T, dim)         | residual stream into block L (0: embeddings) |
| `blocks.{L}.attn.hook_q`       | (T, H, head_dim) | queries as attention uses them (QK-norm, RoPE) |
| `blocks.{L}.attn.hook_k`       | (T, Hkv, head_dim) | keys, likewise: one per K/V head      |
| `blocks.{L}.attn.hook_v`       | (T, Hkv, head_dim) | values                                |
| `blocks.{L}.attn.hook_pattern` | (H, T, T)        | attention probabilities; row = query    |
| `blocks.{L}.attn.hook_z`       | (T, H, head_dim) | each head's output, before o_proj       |
| `blocks.{L}.hook_attn_out`     | (T, dim)         | the output projection's result          |
| `blocks.{L}.hook_resid_mid`    | (T, dim)         | residual stream after attention's share |
| `blocks.{L}.hook_mlp_out`      | (T, dim)         | what the MLP adds to the residual stream |
| `blocks.{L}.hook_resid_post`   | (T, dim)         | residual stream out of block L          |
| `ln_final.hook_normalized`     | (T, dim)         | the final norm's output, read by the head |
| `hook_logits`                  | (T, vocab)       | float32 logits; row i predicts token i + 1 |

H: query heads, Hkv: key/value heads (grouped-query attention: H / Hkv query heads share one).
Interventions act at two sites: `z` (head outputs: ablation, head patching) and `resid_post`
(steering, residual patching). A value kept under a name is the one after the interventions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pellucid.models.config import ModelConfig

# site -> where its name lives in TransformerLens's tree
_ATTENTION_SITES = ("q", "k", "v", "pattern", "z")
_BLOCK_SITES = ("resid_pre", *_ATTENTION_SITES, "attn_out", "resid_mid", "mlp_out", "resid_post")
FINAL_NORM = "ln_final.hook_normalized"
LOGITS = "hook_logits"


def hook_name(site: str, layer: int) -> str:
    if site == "normalized":  # after the last block: one for the model
        return FINAL_NORM
    return f"blocks.{layer}.{'attn.' if site in _ATTENTION_SITES else ''}hook_{site}"


def hook_names(cfg: ModelConfig) -> list[str]:
    """Every name a capture may ask for on a model of this shape, in the order of the pass."""
    names = [hook_name(site, layer) for layer in range(cfg.n_layers) for site in _BLOCK_SITES]
    return [*names, FINAL_NORM, LOGITS]


def pattern_layer(name: str) -> int | None:
    """The layer of a `blocks.{L}.attn.hook_pattern` name; None for other names."""
    parts = name.split(".")
    if len(parts) == 4 and parts[2:] == ["attn", "hook_pattern"]:
        return int(parts[1])
    return None


@dataclass(frozen=True, eq=False)
class Intervention:
    """One change to a request's forward passes, made on its own rows only.

    At `site` ("z": head outputs (T, heads, head_dim); "resid_post": the residual stream (T, dim))
    of `layer`, at `positions` (None: every position, generated ones included), the rows are set
    to `value` (op "set") or have it added (op "add"); at "z" only the columns of `heads`.
    `value` broadcasts over the rows: a scalar, or (len(heads), head_dim) at z, (dim,) at
    resid_post. Build one with `ablate`, `steer` or `patch`.
    """

    kind: str  # "ablate" | "steer" | "patch": what it is for, as a trace shows it
    site: str
    layer: int
    op: str
    value: Tensor
    heads: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None

    def check(self, cfg: ModelConfig, max_len: int, field_name: str = "interventions") -> None:
        """Raise ValueError, naming the field and the valid range, if this model lacks what
        the intervention names."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"{field_name}: {message}")

        require(
            self.site in ("z", "resid_post") and self.op in ("set", "add"),
            f"an intervention sets or adds at z or resid_post, not {self.op} at {self.site}",
        )
        require(
            0 <= self.layer < cfg.n_layers,
            f"layer {self.layer} does not exist: the model has layers 0..{cfg.n_layers - 1}",
        )
        bad = [h for h in self.heads or () if not 0 <= h < cfg.n_heads]
        require(not bad, f"heads {bad} do not exist: the model has heads 0..{cfg.n_heads - 1}")
        bad = [p for p in self.positions or () if not 0 <= p < max_len]
        require(not bad, f"positions {bad} are outside the context: 0..{max_len - 1}")
        shape = (len(self.heads or ()), cfg.head_dim) if self.site == "z" else (cfg.dim,)
        require(
            self.value.dim() == 0 or tuple(self.value.shape) == shape,
            f"a {self.kind} value at layer {self.layer} must be a number or of shape "
            f"{list(shape)}, got {list(self.value.shape)}",
        )
        require(bool(torch.isfinite(self.value).all()), f"the {self.kind} value is not finite")

    def describe(self) -> dict:
        """What it is and where, for a trace (the value as its norm: vectors can be long)."""
        return {
            "kind": self.kind,
            "site": self.site,
            "layer": self.layer,
            "op": self.op,
            "heads": list(self.heads) if self.heads is not None else None,
            "positions": list(self.positions) if self.positions is not None else None,
            "value_norm": float(self.value.norm()),
        }

    def key(self) -> str:
        """Equal for equal interventions: the prefix cache keeps KV computed under one apart."""
        h = hashlib.sha256(
            repr((self.site, self.layer, self.op, self.heads, self.positions)).encode()
        )
        h.update(self.value.float().contiguous().numpy().tobytes())
        return h.hexdigest()


def intervention_key(interventions: list[Intervention]) -> str | None:
    """The prefix cache's salt for KV computed under these; None for none (plain KV)."""
    if not interventions:
        return None
    return hashlib.sha256("".join(iv.key() for iv in interventions).encode()).hexdigest()


def _positions(positions: list[int] | tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if positions is None else tuple(int(p) for p in positions)


def ablate(
    layer: int, heads: list[int], mean: Tensor | None = None, positions: list[int] | None = None
) -> Intervention:
    """Heads' outputs set to zero, or to `mean` (len(heads), head_dim): their average over some
    text (`LLM.mean_ablation` works it out), which keeps the scale the next layers expect."""
    value = torch.tensor(0.0) if mean is None else mean.detach().float()
    return Intervention("ablate", "z", layer, "set", value, tuple(heads), _positions(positions))


def steer(
    layer: int, vector: Tensor, scale: float = 1.0, positions: list[int] | None = None
) -> Intervention:
    """`scale * vector` (dim,) added to the residual stream leaving `layer`, at every position
    (or those given): e.g. the difference of two prompts' activations (`LLM.steering_vector`)."""
    value = vector.detach().float() * scale
    return Intervention("steer", "resid_post", layer, "add", value, None, _positions(positions))


def patch(layer: int, position: int, value: Tensor, head: int | None = None) -> Intervention:
    """One position's residual stream out of `layer` (dim,), or one head's output there
    (head_dim,), replaced by `value`: typically the same activation from another prompt."""
    if head is None:
        return Intervention(
            "patch", "resid_post", layer, "set", value.detach().float(), None, (position,)
        )
    value = value.detach().float()
    value = value.reshape(1, -1) if value.dim() else value  # (1 head, head_dim)
    return Intervention("patch", "z", layer, "set", value, (head,), (position,))


@dataclass(slots=True)
class Capture:
    """Named activations of one request's prompt, kept chunk by chunk as it is pre-filled.
    `last_only`: of its last position only (LLM.inspect: one query row, any context length), and
    then a cached prefix may be read, since no other position is needed."""

    names: set[str]
    last_only: bool = False
    kept: dict[str, list[Tensor]] = field(default_factory=dict)

    def keep(self, name: str, x: Tensor, start: int) -> None:
        """x: the rows of positions start.. (patterns: (heads, rows, keys))."""
        if start == 0:  # from the top: a preempted request computes its prompt again
            self.kept[name] = []
        if self.last_only:  # each chunk's last row; the last chunk's is the one
            x = x[:, -1:] if pattern_layer(name) is not None else x[-1:]
            self.kept[name] = [x]
            return
        self.kept.setdefault(name, []).append(x)

    def result(self, n_tokens: int) -> dict[str, Tensor]:
        """name -> the whole prompt's tensor; patterns padded to (heads, T, T) with zeros for
        the keys each chunk could not see yet (later positions: masked anyway)."""
        out = {}
        for name, chunks in self.kept.items():
            if pattern_layer(name) is not None:
                padded = [torch.nn.functional.pad(c, (0, n_tokens - c.shape[-1])) for c in chunks]
                out[name] = torch.cat(padded, dim=1)
            else:
                out[name] = torch.cat(chunks)
        return out


@dataclass(slots=True)
class _Rows:
    """One request's rows in a step: `rows` (n,) and the positions they compute (n,)."""

    rows: Tensor
    positions: Tensor
    interventions: tuple[Intervention, ...]
    capture: Capture | None


class Probe:
    """What this step's requests look at and change; the model calls `at` at each site."""

    def __init__(self) -> None:
        self.requests: list[_Rows] = []

    def add(
        self,
        first_row: int,
        first_position: int,
        n: int,
        interventions: tuple[Intervention, ...],
        capture: Capture | None,
    ) -> None:
        rows = torch.arange(first_row, first_row + n)
        positions = torch.arange(first_position, first_position + n)
        self.requests.append(_Rows(rows, positions, interventions, capture))

    def at(self, site: str, layer: int, x: Tensor) -> Tensor:
        """x (N, ...) for the step's N rows, edited in place where an intervention says so."""
        for r in self.requests:
            for iv in r.interventions:
                if iv.site == site and iv.layer == layer:
                    _apply(iv, x, r)
            if r.capture is not None:
                name = hook_name(site, layer)
                if name in r.capture.names:
                    r.capture.keep(name, x[r.rows].float(), int(r.positions[0]))
        return x


def _apply(iv: Intervention, x: Tensor, r: _Rows) -> None:
    rows = r.rows
    if iv.positions is not None:
        rows = rows[torch.isin(r.positions, torch.tensor(iv.positions))]
        if len(rows) == 0:
            return
    value = iv.value.to(x.dtype)
    if iv.heads is None:
        x[rows] = value if iv.op == "set" else x[rows] + value
        return
    index = (rows[:, None], torch.tensor(iv.heads)[None, :])  # (rows, heads) of (N, H, hd)
    x[index] = value if iv.op == "set" else x[index] + value
