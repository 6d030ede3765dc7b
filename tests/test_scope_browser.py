"""MegaScope end to end in headless Debian chromium: type, generate, inspect, perturb, see the output change."""
from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")]


@pytest.fixture(scope="module")
def server():
    from megatronapp.data.tokenizer import ByteTokenizer
    from megatronapp.scope.default_model import load_default_model
    from megatronapp.scope.generate import ScopeModel
    from megatronapp.scope.server import ServerThread, create_app

    model, cfg, meta = load_default_model()
    st = ServerThread(create_app(ScopeModel(model, cfg, ByteTokenizer(), name="embedded gpt2-tiny", meta=meta)))
    st.start()
    yield st
    st.stop()


def wait_done(page) -> None:
    page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=300_000)


def output_text(page) -> list[str]:
    return page.eval_on_selector_all("#output .row", "rows => rows.map(r => r.innerText)")


def test_generate_inspect_and_perturb(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_function("!document.getElementById('generate').disabled", timeout=30_000)
        assert "gpt2" in page.inner_text("#model-info")

        page.fill("#prompts", "After Monday comes \nThe sky is")
        page.fill("#ntokens", "12")
        page.click("#generate")
        wait_done(page)
        assert page.locator("#row-0 .tok").count() == 12 and page.locator("#row-1 .tok").count() == 12
        assert "tokens/s" in page.inner_text("#timing")
        topk = page.inner_text("#topk-view")
        assert "top candidates" in topk and "0." in topk  # probabilities shown
        first = output_text(page)
        assert first[0].startswith("0After Monday comes")
        page.screenshot(path=str(tmp_path / "scope_generate.png"), full_page=True)

        # attention for another layer and head; the canvas must hold drawn (non-white) pixels
        page.select_option("#layer", "2")
        page.select_option("#head", "1")
        page.wait_for_function("document.getElementById('attn-caption').textContent.includes('layer 2, head 1')")
        inked = page.evaluate("""() => { const c = document.getElementById('attn').getContext('2d');
            const d = c.getImageData(40, 40, 200, 200).data; let n = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i] < 200) n++; return n; }""")
        assert inked > 100
        assert page.locator("#pca circle").count() == 2 * (len("After Monday comes ") + 12)
        assert page.locator("#lens-view td").count() > 0

        # a bit flip of the top exponent bit in layer 0's output changes what the model writes
        page.check("#pert-enabled")
        page.select_option("#pert-kind", "bitflip")
        page.select_option("#pert-place", "hidden")
        page.fill("#pert-layers", "0")
        page.fill("#pert-rate", "0.02")
        page.fill("#pert-bit", "30")
        page.click("#generate")
        wait_done(page)
        flipped = output_text(page)
        assert flipped != first
        page.screenshot(path=str(tmp_path / "scope_bitflip.png"), full_page=True)

        # off again: back to the unperturbed text (weights and hooks were restored)
        page.uncheck("#pert-enabled")
        page.click("#generate")
        wait_done(page)
        assert output_text(page) == first
        assert not errors, errors
        browser.close()
