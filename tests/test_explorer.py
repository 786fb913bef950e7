"""The explorer page at / in headless Chromium against a live `pellucid serve` (SmolLM2): what it
shows for a token must be what the API says of that token.

With PELLUCID_SCREENSHOTS=1 the screenshots go to docs/ (the README shows them).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import MODEL, Running, serving

from pellucid import LLM
from pellucid.server import create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS = Path(__file__).parents[1] / "docs"
QUESTION = "Name three rivers in Europe, and say into which sea each one flows."
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def server(smollm2: LLM) -> Iterator[Running]:
    with serving(create_app(smollm2, model_name=MODEL)) as running:
        yield running


@contextlib.contextmanager
def explorer(server: Running, max_tokens: int = 200) -> Iterator[object]:
    """The page, loaded, with the model's shape fetched, greedy; page errors fail the test."""
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(server.url + "/")
            page.wait_for_function("window.explorerReady === true", timeout=60_000)
            page.click("#settings summary")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", str(max_tokens))
            yield page
            assert errors == []
        finally:
            browser.close()


def ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function(
        "document.querySelector('#status').textContent.endsWith('tokens')", timeout=300_000
    )


def screenshot(page, name: str, tmp_path: Path) -> None:
    folder = DOCS if os.environ.get("PELLUCID_SCREENSHOTS") else tmp_path
    page.screenshot(path=str(folder / name), full_page=True)


def percent(text: str) -> float:
    return float(re.search(r"([\d.]+)%", text).group(1)) / 100


def test_a_clicked_tokens_attention_lens_and_stages_are_the_apis(server, tmp_path):
    with explorer(server) as page:
        ask(page, QUESTION)
        n_tokens = page.evaluate("turn.tokens.length")
        assert n_tokens >= 10
        # streamed: an event per token (plus the role, the finish and the trace), not one reply
        assert page.evaluate("window.sseEvents") >= n_tokens + 2
        generated = page.locator(".tok:not(.prompt)")
        assert generated.count() == n_tokens
        generated.nth(5).click()
        page.wait_for_selector("#lens table")
        ids, pos = page.evaluate("turn.ids"), page.evaluate("selected")
        n_prompt = page.evaluate("turn.nPrompt")
        view = httpx.post(
            server.url + "/v1/inspect", json={"tokens": ids, "position": pos - 1}, timeout=120
        ).json()
        # attention: the rows shown (head 0 of the layer shown) are the API's weights
        layer = int(page.locator("#layer").input_value())
        row = view["attention"][layer]["heads"][0]
        shown = page.locator("#attention table tr")
        assert shown.count() == min(12, len(row))
        for k in range(shown.count()):
            cells = shown.nth(k).locator("td")
            j = int(cells.nth(0).inner_text())
            assert percent(cells.nth(2).inner_text()) == pytest.approx(row[j], abs=0.0006)
        assert max(row) == pytest.approx(
            percent(shown.nth(0).locator("td").nth(2).inner_text()), abs=6e-4
        )
        # the logit lens: each layer's most likely token and its probability
        lens_rows = page.locator("#lens table tr")
        assert lens_rows.count() == len(view["lens"])
        for layer_view, tr in zip(view["lens"], lens_rows.all(), strict=True):
            first = tr.locator("td").nth(1).inner_text()
            piece = layer_view["top"][0]["piece"].replace("\n", "\\n")
            assert first.startswith(f"'{piece}'")
            assert percent(first) == pytest.approx(layer_view["top"][0]["prob"], abs=6e-4)
        # the last layer's lens is the model's own choice: the token clicked
        assert view["lens"][-1]["top"][0]["id"] == ids[pos]
        # the sampling stages: the API's trace of the same (greedy) request, step by step
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0,
                "max_tokens": 200,
                "top_k": 40,
                "top_p": 0.95,
                "min_p": 0.05,
                "trace": True,
            },
            timeout=300,
        ).json()
        step = reply["pellucid"]["traces"]["0"]["steps"][pos - n_prompt]
        assert step["token"]["id"] == ids[pos]
        text = page.locator("#sampling").inner_text()
        for stage in step["stages"]:
            assert stage["name"] in text
            assert f"{stage['top'][0]['prob'] * 100:.1f}%" in text
        screenshot(page, "explorer.png", tmp_path)


def test_ablating_a_layer_on_the_page_changes_the_answer_and_removing_it_restores_it(
    server, tmp_path
):
    with explorer(server, max_tokens=40) as page:
        ask(page, QUESTION)
        plain = page.evaluate("turn.text")
        page.select_option("#iv-layer", "3")
        page.click("#iv-heads button:has-text('all')")
        page.click("#iv-ablate")
        assert "ablate at layer 3" in page.locator("#iv-list").inner_text()
        page.click("#regenerate")
        page.wait_for_function("turn.text !== '' && !document.querySelector('#send').disabled")
        ablated = page.evaluate("turn.text")
        assert ablated != plain
        page.click("#iv-list button:has-text('remove')")
        page.click("#regenerate")
        page.wait_for_function("turn.text !== '' && !document.querySelector('#send').disabled")
        assert page.evaluate("turn.text") == plain
        # the chat, kept in the browser, comes back on reload
        page.reload()
        page.wait_for_function("window.explorerReady === true")
        assert page.locator(".msg.assistant").count() == 1
        assert page.locator(".msg.user").count() == 1


def test_patching_on_the_page_draws_the_heatmap(server, tmp_path):
    with explorer(server) as page:
        page.click("#pt-run")
        page.wait_for_selector("#pt-out table", timeout=120_000)
        assert "' Paris'" in page.locator("#pt-out").inner_text()
        cells = page.locator("#pt-out table tr").nth(1).locator("td.cell")
        assert cells.count() == 5  # The / capital / of / France / is
        screenshot(page, "explorer-patching.png", tmp_path)
