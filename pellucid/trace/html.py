"""One self-contained HTML page from an Explanation: the trace as JSON inside report.html, whose
inline script draws the tokens, their alternatives, the attention heatmap, the timeline and the
KV cache. No network, no CDN: the file opens anywhere, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from pellucid.trace.records import Explanation

TEMPLATE = Path(__file__).with_name("report.html")
PLACEHOLDER = "__TRACE_JSON__"


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


def _rounded(x: object) -> object:
    """Floats to 5 significant digits: attention for every layer and head stays a small page."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x
