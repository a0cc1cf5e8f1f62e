"""The chat page at GET /, in a real browser: Debian's chromium driven by playwright, against
the same small server tests/test_server.py starts. Skipped, with the reason, where either is
missing (playwright's own browser download cannot be used: it needs the network)."""
from __future__ import annotations

import re
import shutil
import time

import pytest

from test_server import server  # noqa: F401 -- the module-scoped server fixture, one more instance

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")]
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"]
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, server):  # noqa: F811
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"http://127.0.0.1:{server.port}/")
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    yield page
    context.close()


def _ask(page, question: str, max_tokens: int, temperature: str = "0") -> None:
    page.fill("#temperature", temperature)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#question", question)
    page.press("#question", "Enter")


def _answers(page) -> list[str]:
    return page.locator(".message.assistant .text").all_inner_texts()


def test_a_question_gets_a_streamed_answer_with_the_servers_figures(page):
    assert page.inner_text("#model") == "model: embedded"
    # Read the same response the page reads: a copy of its body, its SSE events and their deltas.
    # (Counting the page's DOM changes instead depends on timing: a busy browser renders several
    # events at once.)
    page.evaluate("""() => {
      window.sse = {events: 0, text: ''};
      const plain = window.fetch;
      window.fetch = async (...args) => {
        const r = await plain(...args);
        if (!String(args[0]).includes('/v1/chat/completions')) return r;
        const [mine, theirs] = r.body.tee();
        (async () => {
          const reader = mine.getReader(), dec = new TextDecoder();
          let buf = '';
          for (;;) {
            const {done, value} = await reader.read();
            if (done) break;
            buf += dec.decode(value, {stream: true});
            let at;
            while ((at = buf.indexOf('\\n\\n')) >= 0) {
              const ev = buf.slice(0, at); buf = buf.slice(at + 2);
              if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
              const c = JSON.parse(ev.slice(6)), delta = c.choices && c.choices[0] && c.choices[0].delta;
              if (delta && delta.content) { window.sse.events++; window.sse.text += delta.content; }
            }
          }
        })();
        return new Response(theirs, {status: r.status, statusText: r.statusText, headers: r.headers});
      };
    }""")
    _ask(page, "What is the capital of Japan?", 64)
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    answer = _answers(page)[-1]
    assert "Tokyo" in answer
    sse = page.evaluate("window.sse")
    assert sse["events"] > 3, sse                           # the server streamed it piece by piece
    assert sse["text"].strip() == answer.strip()           # and the page shows what it streamed
    stats = page.locator(".message.assistant .stats").last.inner_text()
    assert re.search(r"prompt \d+ tokens · \d+ reused · \d+ generated · TTFT [\d.]+ s · [\d.]+ tokens/s", stats), stats


def test_stop_ends_an_answer_mid_way_and_the_server_frees_the_device(page, server):  # noqa: F811
    cancelled = server.log().count("cancelled by client")
    _ask(page, "Write a very long story about a dragon.", 400, temperature="0.8")
    page.wait_for_function("document.querySelector('.message.assistant .text').innerText.length > 20",
                           timeout=WAIT_MS)
    page.click("#stop")
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert page.locator(".message.assistant .stats").last.inner_text().startswith("stopped")
    assert not page.is_disabled("#send")
    deadline = time.monotonic() + 5
    while server.log().count("cancelled by client") == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    line = [l for l in server.log().splitlines() if "cancelled by client" in l][-1]
    assert int(re.search(r"(\d+) generated", line).group(1)) < 400, line


def test_a_conversation_survives_a_reload_and_markdown_is_escaped(page):
    _ask(page, "Say <b>hi</b> in one word.", 8)
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    answer = _answers(page)[-1]
    page.reload()
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    assert page.locator(".message.user .text").last.inner_text() == "Say <b>hi</b> in one word."
    assert page.locator(".message.user b").count() == 0       # shown as text, never as markup
    assert _answers(page)[-1] == answer
    assert page.locator("#conversations li").count() >= 1
    page.click("#new")
    assert page.locator(".message").count() == 0


def test_code_blocks_and_lists_render_as_such(page):
    html = page.evaluate("markdown('Steps:\\n- one\\n- **two**\\n\\n```python\\nprint(\"<x>\")\\n```')")
    assert html == ('<p>Steps:</p><ul><li>one</li><li><strong>two</strong></li></ul>'
                    '<pre><code>print(&quot;&lt;x&gt;&quot;)\n</code></pre>')
