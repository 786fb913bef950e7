"""Interventions worked out from the model's own activations, and activation patching.

    from pellucid.probing import activation_patching, steer, steering_vector
    v = steering_vector(llm, "I love this, it makes me happy", "I hate this, it makes me angry", 6)
    llm.generate(prompt, SamplingParams(interventions=[steer(6, v, scale=2)]))
    p = activation_patching(llm, "The capital of France is", "The capital of Italy is")
    p.scores  # (layers, positions): how much of the clean answer each patch brings back

Every pass here is a request to the engine (`LLM.run_with_caches`): a patching sweep's hundreds of
patched runs are batched together like any other requests. The JSON form of interventions (the
server's `interventions` field) is read here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pellucid.engine.probes import Intervention, ablate, hook_name, patch, steer
from pellucid.engine.sampling_params import is_int, is_number, require
from pellucid.llm import LLM, Prompt


def mean_ablation(llm: LLM, layer: int, heads: list[int], text: Prompt) -> Intervention:
    """Heads set to their mean output over `text`'s positions (rather than to zero, which no
    layer after them ever saw)."""
    name = hook_name("z", layer)
    _, cache = llm.run_with_cache(text, [name])
    return ablate(layer, heads, mean=cache[name][:, heads].mean(0))


def steering_vector(llm: LLM, positive: Prompt, negative: Prompt, layer: int) -> Tensor:
    """(dim,) the residual stream out of `layer`, averaged over `positive`'s positions, minus the
    same for `negative`: the direction from one to the other, to add with `steer`. The first
    position is left out of both: most models park outsized activations there (an attention
    sink), which would swamp the difference."""
    name = hook_name("resid_post", layer)
    (_, pos), (_, neg) = llm.run_with_caches([positive, negative], [name])
    if min(len(pos[name]), len(neg[name])) < 2:
        raise ValueError(
            "each steering prompt needs at least two tokens (the first one, an attention sink, "
            "is left out): write a few words, e.g. 'I love this' / 'I hate this'"
        )
    return pos[name][1:].mean(0) - neg[name][1:].mean(0)


@dataclass
class Patching:
    """The result of `activation_patching`: scores[layer, i] = how much of the way from the
    corrupted answer back to the clean one patching column i of that layer goes (1: all of it,
    0: none); columns are positions (site "resid_post") or heads (site "z")."""

    site: str
    tokens: list[str]  # the prompt's tokens (of the clean prompt)
    answers: tuple[str, str]  # the clean and the corrupted prompt's next token
    clean: float  # logit(clean answer) - logit(corrupted answer), on the clean prompt
    corrupted: float  # the same on the corrupted prompt
    scores: Tensor  # (layers, positions) or (layers, heads)

    def table(self) -> str:
        """The scores as text, a row per layer (what `pellucid patch` prints)."""
        columns = (
            self.tokens
            if self.site == "resid_post"
            else [f"h{h}" for h in range(self.scores.shape[1])]
        )
        width = 2 + max(5, *(len(repr(c)) for c in columns))
        lines = ["layer " + "".join(f"{c!r:>{width}}" for c in columns)]
        for layer, row in enumerate(self.scores.tolist()):
            lines.append(f"{layer:>5} " + "".join(f"{v:>{width}.2f}" for v in row))
        return "\n".join(lines)

    def write_png(self, path: str | Path) -> Path:
        """The heatmap as a PNG (matplotlib, no display needed)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows, cols = self.scores.shape
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * cols, 0.9 + 0.22 * rows))
        image = ax.imshow(self.scores, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
        labels = self.tokens if self.site == "resid_post" else [f"head {h}" for h in range(cols)]
        ax.set_xticks(range(cols), [repr(t) for t in labels], rotation=30, ha="right")
        ax.set_ylabel("layer (residual stream after it)" if self.site == "resid_post" else "layer")
        ax.set_title(
            f"patching clean -> corrupted: share of {self.answers[0]!r} vs {self.answers[1]!r} restored",
            fontsize=9,
        )
        fig.colorbar(image, ax=ax, fraction=0.05)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def activation_patching(
    llm: LLM, clean: Prompt, corrupted: Prompt, site: str = "resid_post"
) -> Patching:
    """Run the corrupted prompt again and again, each time with one activation taken from the
    clean run: the residual stream out of each layer at each position (site "resid_post"), or
    each head's output at every position (site "z"). The metric is the logit difference between
    the two prompts' answers, at the last position."""
    if site not in ("resid_post", "z"):
        raise ValueError(f"site must be 'resid_post' or 'z', got {site!r}")
    clean_ids, corrupted_ids = llm.encode(clean), llm.encode(corrupted)
    if len(clean_ids) != len(corrupted_ids):
        raise ValueError(
            f"the clean prompt has {len(clean_ids)} tokens and the corrupted one "
            f"{len(corrupted_ids)}: patching pairs positions, so they must have as many "
            "(change a word for one of the same token length)"
        )
    cfg = llm.model.cfg
    names = [hook_name(site, layer) for layer in range(cfg.n_layers)]
    (clean_logits, cache), (bad_logits, _) = llm.run_with_caches([clean_ids, corrupted_ids], names)
    good, bad = int(clean_logits[-1].argmax()), int(bad_logits[-1].argmax())

    def metric(logits: Tensor) -> float:
        return float(logits[-1, good] - logits[-1, bad])

    runs = [
        _patches(cache[name], layer, column, site)
        for layer, name in enumerate(names)
        for column in range(len(clean_ids) if site == "resid_post" else cfg.n_heads)
    ]
    patched = llm.run_with_caches([corrupted_ids] * len(runs), [], runs)
    top, bottom = metric(clean_logits), metric(bad_logits)
    span = top - bottom if top != bottom else 1.0
    scores = torch.tensor([(metric(logits) - bottom) / span for logits, _ in patched])
    return Patching(
        site,
        [llm.tokenizer.decode([t]) for t in clean_ids],
        (llm.tokenizer.decode([good]), llm.tokenizer.decode([bad])),
        top,
        bottom,
        scores.view(cfg.n_layers, -1),
    )


def _patches(kept: Tensor, layer: int, column: int, site: str) -> list[Intervention]:
    """The interventions of one patched run: position `column` of the residual stream, or head
    `column`'s output at every position, set to the clean run's."""
    if site == "resid_post":
        return [patch(layer, column, kept[column])]
    return [patch(layer, p, kept[p, column], head=column) for p in range(len(kept))]


def interventions_from_json(
    llm: LLM, specs: list[dict[str, Any]], prompt: Prompt
) -> list[Intervention]:
    """The server's `interventions` field, read into Interventions (ValueError naming the
    entry and field otherwise); a mean ablation without `mean_over` averages over `prompt`."""
    require(isinstance(specs, list), "interventions must be a list of objects")
    out = []
    for i, spec in enumerate(specs):
        where = f"interventions[{i}]"
        require(isinstance(spec, dict), f"{where} must be an object with a 'type'")
        kind = spec.get("type")
        read = _READERS.get(kind)
        if read is None:
            raise ValueError(f"{where}.type must be one of {sorted(_READERS)}, got {kind!r}")
        fields = _Fields(spec, where)
        out.append(read(llm, fields, prompt))
        fields.check_unused()
        out[-1].check(llm.model.cfg, llm.engine.max_model_len, where)
    return out


class _Fields:
    """One JSON intervention's fields, each read once and checked on the way."""

    def __init__(self, spec: dict[str, Any], where: str):
        self.spec, self.where, self.read = spec, where, {"type"}

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        self.read.add(name)
        if name not in self.spec:
            if default is ...:
                raise ValueError(f"{self.where}.{name} is required")
            return default
        value = self.spec[name]
        require(
            not isinstance(value, bool) and isinstance(value, kind),
            f"{self.where}.{name} has the wrong type: {value!r}",
        )
        return value

    def ints(self, name: str, default: Any = ...) -> list[int] | None:
        values = self.get(name, list, default)
        if values is not None and not all(is_int(v) for v in values):
            raise ValueError(f"{self.where}.{name} must be a list of integers, got {values!r}")
        return values

    def vector(self, name: str) -> Tensor:
        values = self.get(name, list)
        if not values or not all(is_number(v) for v in values):
            raise ValueError(f"{self.where}.{name} must be a non-empty list of numbers")
        return torch.tensor(values, dtype=torch.float32)

    def check_unused(self) -> None:
        extra = sorted(set(self.spec) - self.read)
        if extra:
            raise ValueError(f"{self.where} has unknown fields {extra}")


def _read_ablate(llm: LLM, f: _Fields, prompt: Prompt) -> Intervention:
    layer, heads = f.get("layer", int), f.ints("heads")
    positions = f.ints("positions", None)
    mode = f.get("mode", str, "zero")
    zero = _checked(llm, ablate(layer, heads, positions=positions), f)
    if mode == "zero":
        return zero
    if mode != "mean":
        raise ValueError(f"{f.where}.mode must be 'zero' or 'mean', got {mode!r}")
    found = mean_ablation(llm, layer, heads, f.get("mean_over", str, None) or prompt)
    return ablate(layer, heads, mean=found.value, positions=positions)


def _read_steer(llm: LLM, f: _Fields, prompt: Prompt) -> Intervention:
    layer, scale = f.get("layer", int), float(f.get("scale", (int, float), 1.0))
    positions = f.ints("positions", None)
    if "prompts" in f.spec:
        pair = f.get("prompts", list)
        if len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
            raise ValueError(f"{f.where}.prompts must be two non-empty strings [toward, away]")
        _checked(llm, steer(layer, torch.tensor(0.0)), f)
        return steer(layer, steering_vector(llm, pair[0], pair[1], layer), scale, positions)
    return steer(layer, f.vector("vector"), scale, positions)


def _read_patch(llm: LLM, f: _Fields, prompt: Prompt) -> Intervention:
    layer, position = f.get("layer", int), f.get("position", int)
    head = f.get("head", int, None)
    if "from_prompt" in f.spec:  # the value at the same place in another prompt's pass
        _checked(llm, patch(layer, position, torch.tensor(0.0), head), f)
        site = "resid_post" if head is None else "z"
        name = hook_name(site, layer)
        _, cache = llm.run_with_cache(f.get("from_prompt", str), [name])
        if not 0 <= position < len(cache[name]):
            raise ValueError(
                f"{f.where}.position {position} is outside from_prompt: 0..{len(cache[name]) - 1}"
            )
        kept = cache[name][position]
        return patch(layer, position, kept if head is None else kept[head], head)
    return patch(layer, position, f.vector("value"), head)


def _checked(llm: LLM, iv: Intervention, f: _Fields) -> Intervention:
    """Its layer, heads and positions checked before a pass that reads them."""
    iv.check(llm.model.cfg, llm.engine.max_model_len, f.where)
    return iv


_READERS = {"ablate": _read_ablate, "steer": _read_steer, "patch": _read_patch}


def inspect_position(
    llm: LLM,
    token_ids: list[int],
    position: int,
    interventions: list[Intervention] | None = None,
    top_k: int = 5,
) -> dict[str, Any]:
    """One position of a text as the model saw it: the attention row of its query at every
    layer and head (over positions 0..position), and the logit lens there (what each layer
    would predict for the next token), as JSON-ready lists. One pass through the engine that
    computes this position alone: the text before it comes from the prefix cache when it was
    just generated (under the same interventions)."""
    if not 0 <= position < len(token_ids):
        raise ValueError(f"position {position} is outside the text: 0..{len(token_ids) - 1}")
    cfg, tok = llm.model.cfg, llm.tokenizer
    layers = range(cfg.n_layers)
    names = [hook_name(site, layer) for site in ("pattern", "resid_post") for layer in layers]
    ((_, cache),) = llm.run_with_caches(
        [token_ids[: position + 1]], names, [interventions or []], last_only=True
    )

    def piece(i: int) -> dict[str, Any]:
        return {"id": i, "piece": tok.id_to_piece(i), "special": tok.is_special(i)}

    with torch.inference_mode():  # every layer's last residual stream, read by the final norm
        stream = torch.cat([cache[hook_name("resid_post", layer)] for layer in layers])
        probs = llm.model.compute_logits(llm.model.norm(stream.to(llm.dtype))).softmax(-1)
    top = probs.topk(top_k)
    return {
        "position": position,
        "token": piece(token_ids[position]),
        "next": piece(token_ids[position + 1]) if position + 1 < len(token_ids) else None,
        "query_heads_per_kv_head": cfg.n_heads // cfg.n_kv_heads,
        "attention": [
            {"layer": layer, "heads": cache[hook_name("pattern", layer)][:, 0].tolist()}
            for layer in layers
        ],
        "lens": [
            {
                "layer": layer,
                "top": [
                    piece(int(i)) | {"prob": float(p)}
                    for p, i in zip(top.values[layer], top.indices[layer])
                ],
            }
            for layer in layers
        ],
    }
