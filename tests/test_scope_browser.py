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

        # the layer x head grid shows every layer; clicking a cell opens that layer and head
        assert page.get_attribute("#grid", "data-layers") == "0,1,2,3"
        page.click("#grid", position={"x": 56 + 1 * 40 + 20, "y": 16 + 3 * 22 + 11})  # layer 3, head 1
        page.wait_for_function("document.getElementById('attn-caption').textContent.includes('layer 3, head 1')")
        assert page.input_value("#layer") == "3" and page.input_value("#head") == "1"
        page.select_option("#grid-metric", "q_norm")
        page.wait_for_function("document.getElementById('grid-caption').textContent.includes('query norm')")

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


FOREIGN_PAGE = """<!doctype html><title>foreign</title><body><script>
const ws = new WebSocket("ws://127.0.0.1:%d/ws");
ws.onmessage = (e) => { document.body.dataset.got = (document.body.dataset.got || "") + e.data.slice(0, 20); };
ws.onclose = (e) => { document.body.dataset.code = e.code; document.body.dataset.reason = e.reason; };
</script></body>"""


def test_page_on_another_port_is_refused(server):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from playwright.sync_api import sync_playwright

    class Foreign(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            body = (FOREIGN_PAGE % server.port).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{other.server_port}/")
            page.wait_for_function("document.body.dataset.code !== undefined", timeout=60_000)
            assert page.evaluate("document.body.dataset.code") == "1008"
            reason = page.evaluate("document.body.dataset.reason")
            assert f"origin http://127.0.0.1:{other.server_port} refused: only this server" in reason
            assert page.evaluate("document.body.dataset.got") is None  # not even the hello
            browser.close()
    finally:
        other.shutdown()


def test_training_console_pause_step_resume(tmp_path):
    import threading

    from playwright.sync_api import sync_playwright

    from megatronapp.config import ModelConfig
    from megatronapp.model.transformer import build_model
    from megatronapp.scope.training import TrainingScope

    cfg = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
    model = build_model(cfg, seed=0)
    scope = TrainingScope(0, every=3, token="t ok/en", probe="ab", probe_tokens=2, announce=lambda s: None)
    done: list[int] = []
    stop = threading.Event()

    def trainer() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            scope.on_step(step, [model], {"loss": 1.0 / step})
            done.append(step)
            stop.wait(0.02)

    runner = threading.Thread(target=trainer, daemon=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.goto(f"http://127.0.0.1:{scope.server.port}/?token=t%20ok%2Fen")
            page.wait_for_function("!document.getElementById('console').hidden", timeout=30_000)
            runner.start()
            page.click("#train-pause")
            page.wait_for_function("document.getElementById('train-state').dataset.waiting === 'true'",
                                   timeout=60_000)
            held = int(page.get_attribute("#train-state", "data-step"))
            assert done == list(range(1, held))
            page.click("#train-step")
            page.wait_for_function(f"(() => {{ const d = document.getElementById('train-state').dataset; "
                                   f"return d.waiting === 'true' && d.step === '{held + 1}'; }})()", timeout=60_000)
            assert done == list(range(1, held + 1))
            page.fill("#train-every", "5")
            page.click("#train-every-set")
            page.wait_for_function("document.getElementById('train-state').dataset.every === '5'")
            page.screenshot(path=str(tmp_path / "scope_console.png"), full_page=True)
            page.click("#train-resume")
            page.wait_for_function(f"Number(document.getElementById('train-state').dataset.step) > {held + 3}",
                                   timeout=60_000)
            assert scope.every == 5 and not scope.paused
            browser.close()
    finally:
        stop.set()
        scope.close()
        runner.join(timeout=30)
