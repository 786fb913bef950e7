"""`pellucid explain`: the walk-through in the seed's order, the no-cache and training experiments,
the PNG plots, and the HTML report (opened in headless Chromium when it is installed)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
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
    assert "__STATIC_DATA__" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # no network at all
    assert "@import" not in page
    data = json.loads(
        re.search(
            r'<script id="static-data" type="application/json">(.*?)</script>', page, re.DOTALL
        ).group(1)
    )
    assert data["trace"]["tokenization"]["tokens"][1]["piece"] == " bank"
    n_prompt, n_steps = 6, len(explained.trace.steps)
    assert sorted(int(q) for q in data["views"]) == list(range(n_prompt + n_steps - 1))


def test_a_static_view_is_what_the_engine_shows_of_that_position(explained, smollm2):
    """The file's view of a position (from the trace) against /v1/inspect's (a new pass)."""
    from pellucid.probing import inspect_position
    from pellucid.trace.html import static_data

    t = explained.trace
    ids = [k.id for k in t.tokenization.tokens] + [s.token.id for s in t.steps]
    views = static_data(explained)["views"]
    for q in (2, len(t.tokenization.tokens) - 1, len(ids) - 2):
        live = inspect_position(smollm2, ids, q)
        for kept, fresh in zip(views[q]["attention"], live["attention"], strict=True):
            assert kept["layer"] == fresh["layer"]
            assert torch.allclose(
                torch.tensor(kept["heads"]), torch.tensor(fresh["heads"]), atol=1e-4
            )
        if views[q]["lens"]:  # positions that sampled a token
            assert [x["top"][0]["id"] for x in views[q]["lens"]] == [
                x["top"][0]["id"] for x in live["lens"]
            ]


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
def test_html_explorer_file_in_headless_chromium(explained, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    path = write_html(explained, tmp_path / "explain.html")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route(
                "**/*",
                lambda route: (
                    route.abort()
                    if not route.request.url.startswith("file:")
                    else route.continue_()
                ),
            )  # prove it works offline
            page.goto(path.as_uri())
            page.wait_for_function("window.explorerReady === true")
            generated = page.locator("#tokens .tok:not(.prompt)")
            assert generated.count() == len(explained.trace.steps)
            assert page.locator("#tokens .tok.prompt").count() == 6
            assert page.locator("#timeline rect").count() == len(explained.trace.steps)
            generated.nth(1).click()
            page.wait_for_selector("#lens table")
            assert "step 1" in page.locator("#sampling").inner_text()
            assert page.locator("#lens table tr").count() == explained.trace.model.layers
            assert page.locator("#attention table tr").count() > 0
            assert "slower" in page.locator("#p-experiments").inner_text()
            page.locator("#tokens .tok.prompt").nth(2).click()  # a prompt token: attention only
            page.wait_for_selector("#attention table")
            assert "the live explorer computes it" in page.locator("#lens").inner_text()
            shot = page.screenshot(path=str(tmp_path / "explain.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()
    assert len(shot) > 20_000  # a drawn page, not a blank one
