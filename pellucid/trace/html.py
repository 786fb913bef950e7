"""Self-contained HTML pages: an Explanation as one report (the trace as JSON inside report.html,
whose inline script draws tokens, alternatives, attention, the timeline and the KV cache), and the
server's live chat view (web.html). No network, no CDN: both work offline.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from pellucid.trace.records import Explanation

TEMPLATE = Path(__file__).with_name("report.html")
PLACEHOLDER = "__TRACE_JSON__"
WEB_VIEW = Path(__file__).with_name("web.html")


def render_html(ex: Explanation) -> str:
    data = json.dumps(_rounded(ex.to_dict()), ensure_ascii=False, separators=(",", ":"))
    # "</script>" inside the JSON would end the script element early; "<\/" means the same in JSON.
    data = data.replace("</", "<\\/")
    return TEMPLATE.read_text(encoding="utf-8").replace(PLACEHOLDER, data)


def write_html(ex: Explanation, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(ex), encoding="utf-8")
    return path


def web_view(model_name: str, n_layers: int, n_heads: int) -> str:
    """The chat page `pellucid serve` shows at /, for a model of this shape."""
    page = WEB_VIEW.read_text(encoding="utf-8")
    return (
        page.replace("__MODEL_NAME__", html.escape(model_name))
        .replace("__N_LAYERS__", str(n_layers))
        .replace("__N_HEADS__", str(n_heads))
    )


def _rounded(x: object) -> object:
    """Floats to 5 significant digits: attention for every layer and head stays a small page."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x
