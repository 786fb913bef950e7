"""`pellucid explain`: the walk-through in the seed's order, the no-cache and training experiments,
the PNG plots, and the HTML report (opened in headless Chromium when it is installed)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from rich.console import Console

from pellucid.cli import build_parser, run_explain
from pellucid.engine.sampling_params import SamplingParams
from pellucid.trace.explain import explain, find_focus, training_walk, weights_fingerprint
from pellucid.trace.html import render_html, write_html
from pellucid.trace.plots import write_plots
from pellucid.trace.terminal import render

SECTIONS = [
    "Tokenization",
    "Pre-fill",
    "Attention",
    "KV cache",
    "autoregressive loop",
    "Final output",
    "Without the KV cache",
]


@pytest.fixture(scope="module")
def explained(smollm2):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0, max_tokens=4)
    return explain(
        smollm2, "The bank is near the river", params, focus="bank", compare_no_cache=True
    )


def test_terminal_walks_through_in_the_seeds_order(explained):
    console = Console(record=True, width=120, color_system=None)
    render(explained, console)
    text = console.export_text()
    positions = [text.find(title) for title in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), positions
    assert "46,080 bytes" in text  # SmolLM2's KV bytes per token in float32
    assert "' bank' looks at" in text and "is looked at by" in text
    assert re.search(r"\d+\.\d× slower \(measured\)", text)
    assert explained.trace.output_text in text


def test_explanation_numbers(explained, smollm2):
    t = explained.trace
    assert explained.focus == 1  # ' bank'
    assert len(t.attention) == smollm2.model.cfg.n_layers  # every layer, for the page
    assert t.bandwidth_limit_gbs > 0
    assert all(s.gb_per_s > 0 for s in t.steps)
    c = explained.no_cache
    assert c.tokens == len(t.steps) and c.same_tokens
    assert c.uncached_flops > c.cached_flops > 0 and c.cached_s > 0 and c.uncached_s > 0


def test_focus_must_be_a_prompt_token(explained):
    with pytest.raises(ValueError, match="not one of the prompt's tokens"):
        find_focus(explained.trace, "castle")


def test_training_lowers_the_loss_on_a_copy(smollm2):
    before = weights_fingerprint(smollm2.model)
    walk = training_walk(smollm2, "Paris is in France.", before, steps=2)
    losses = [s.loss for s in walk.steps] + [walk.final_loss]
    assert losses == sorted(losses, reverse=True) and walk.final_loss < walk.steps[0].loss
    assert walk.final_target_prob > walk.steps[0].target_prob
    assert all(s.grad_norm > 0 and s.update_norm > 0 for s in walk.steps)
    assert walk.weights_changed == walk.weights_total
    assert walk.inference_unchanged and weights_fingerprint(smollm2.model) == before


def test_png_plots(explained, tmp_path):
    paths = write_plots(explained, tmp_path)
    names = {p.stem for p in paths}
    assert {
        "attention",
        "attention_heads",
        "timing",
        "kv_cache",
        "probabilities",
        "stages",
        "no_cache",
    } <= names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_is_self_contained(explained):
    page = render_html(explained)
    assert "__TRACE_JSON__" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # no network at all
    assert "@import" not in page and "fetch(" not in page
    data = re.search(
        r'<script id="trace-data" type="application/json">(.*?)</script>', page, re.DOTALL
    ).group(1)
    assert json.loads(data)["trace"]["tokenization"]["tokens"][1]["piece"] == " bank"


def test_cli_explain_arguments():
    args = build_parser().parse_args(
        [
            "explain",
            "Hi there",
            "--compare-no-cache",
            "--html",
            "r.html",
            "--png",
            "plots",
            "--focus",
            "there",
        ]
    )
    assert args.run is run_explain and args.max_tokens == 16 and args.seed == 0
    assert args.compare_no_cache and args.html == "r.html" and args.png == "plots"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_html_report_in_headless_chromium(explained, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    path = write_html(explained, tmp_path / "report.html")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1600})
            page.route(
                "**/*",
                lambda route: (
                    route.abort()
                    if not route.request.url.startswith("file:")
                    else route.continue_()
                ),
            )  # prove it works offline
            page.goto(path.as_uri())
            generated = page.locator("#tokens .tok.gen")
            assert generated.count() == len(explained.trace.steps)
            assert page.locator("#tokens .tok.prompt").count() == 6
            cells = page.locator("#heatmap td.cell")
            assert cells.count() == 6 * 7 // 2  # the causal triangle of 6 prompt tokens
            assert page.locator("#timeline rect").count() == 1 + len(explained.trace.steps) - 1
            generated.nth(1).click()
            assert "Step 1" in page.locator("#details").inner_text()
            assert page.locator("#details table.alternatives tr").count() == 1 + 6  # 6 stages
            shot = page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert len(shot) > 20_000  # a drawn page, not a blank one
