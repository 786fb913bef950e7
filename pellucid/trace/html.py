"""Self-contained HTML pages, no network and no CDN (both work offline): the server's explorer
(web.html, at /), and the same page as a file for an Explanation (`pellucid explain --html`),
where what the live page asks the server for (the model's shape, a token's attention and logit
lens) is read from the trace, written into the page as JSON.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from pellucid.engine.trace_records import Trace
from pellucid.trace.records import Explanation

WEB_VIEW = Path(__file__).with_name("web.html")
STATIC_PLACEHOLDER = "__STATIC_DATA__"


def web_view(model_name: str) -> str:
    """The explorer page `pellucid serve` shows at / (it asks the server for the model's shape)."""
    return WEB_VIEW.read_text(encoding="utf-8").replace("__MODEL_NAME__", html.escape(model_name))


def render_html(ex: Explanation) -> str:
    """The explorer as one file, showing the explained run."""
    data = json.dumps(_rounded(static_data(ex)), ensure_ascii=False, separators=(",", ":"))
    # "</script>" inside the JSON would end the script element early; "<\/" means the same in JSON.
    data = data.replace("</", "<\\/")
    return web_view(ex.trace.model.name).replace(STATIC_PLACEHOLDER, data)


def write_html(ex: Explanation, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(ex), encoding="utf-8")
    return path


def static_data(ex: Explanation) -> dict[str, Any]:
    """What the page would ask the server: the model's facts, the run's trace, and for each
    position the inspect view (/v1/inspect's shape) the trace holds."""
    t = ex.trace
    info = {
        **t.model.shape(),
        "kv_bytes_per_token": t.kv.bytes_per_token,
        "limits": {"bandwidth_gbs": t.bandwidth_limit_gbs or 0, "flops": t.flops_limit or 0},
    }
    n_prompt = len(t.tokenization.tokens)
    n_views = n_prompt + len(t.steps) - 1  # the last token was never a query
    return {
        "info": info,
        "prompt": t.tokenization.text,
        "trace": t.to_dict(),
        "views": {q: _view(t, q) for q in range(n_views)},
        "experiments": _experiments(ex),
    }


def _view(t: Trace, q: int) -> dict[str, Any]:
    """Position q as /v1/inspect gives it: its attention row at each traced layer (every head),
    and its logit lens where q sampled a token (the prompt's last position and the reply's)."""
    n_prompt = len(t.tokenization.tokens)
    ids = [k.id for k in t.tokenization.tokens] + [s.token.id for s in t.steps]
    piece = {k.id: k.piece for k in t.tokenization.tokens} | {
        s.token.id: s.token.piece for s in t.steps
    }
    attention = []
    for amap in sorted(t.attention, key=lambda a: a.layer):
        rows = amap.prompt if q < n_prompt else amap.steps[q - n_prompt]
        heads = [h[q][: q + 1] for h in rows] if q < n_prompt else [h[: q + 1] for h in rows]
        attention.append({"layer": amap.layer, "heads": heads})
    step = q - n_prompt + 1  # the step whose token this position sampled
    lens = t.steps[step].lens if 0 <= step < len(t.steps) else []
    return {
        "position": q,
        "token": {"id": ids[q], "piece": piece[ids[q]]},
        "next": {"id": ids[q + 1], "piece": piece[ids[q + 1]]},
        "query_heads_per_kv_head": t.model.heads // t.model.kv_heads,
        "attention": attention,
        "lens": [
            {
                "layer": x.layer,
                "top": [{"id": c.id, "piece": c.piece, "prob": c.prob} for c in x.top],
            }
            for x in lens
        ],
    }


def _experiments(ex: Explanation) -> list[str]:
    """The explain-only experiments, one sentence each (HTML-escaped by the page)."""
    out = []
    if ex.no_cache is not None:
        c = ex.no_cache
        out.append(
            f"Without the KV cache the same {c.tokens} tokens took {c.uncached_s:.2f} s instead "
            f"of {c.cached_s:.2f} s: {c.slowdown:.1f}x slower, {c.uncached_flops / 1e9:.1f} vs "
            f"{c.cached_flops / 1e9:.1f} GFLOP (same tokens: {'yes' if c.same_tokens else 'no'})."
        )
    if ex.training is not None:
        w = ex.training
        losses = " -> ".join(f"{s.loss:.3f}" for s in w.steps)
        out.append(
            f"Training on '{w.sentence}': loss {losses} -> {w.final_loss:.3f}; the served "
            f"weights unchanged by inference: {'yes' if w.inference_unchanged else 'no'}."
        )
    return out


def _rounded(x: object) -> object:
    """Floats to 5 significant digits: attention for every layer and head stays a small page."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x
