"""The chat page at GET /, in a real browser: Debian's chromium driven by playwright, against
the same small server tests/test_server.py starts. Skipped, with the reason, where either is
missing (playwright's own browser download cannot be used: it needs the network).

The page's tests run at a desktop's size and a phone's; stored conversations are put in
localStorage before a load where a test needs an answer the small model would not write."""
from __future__ import annotations

import json
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
STORE = "llama32-chat"
VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}
NARROWEST = {"width": 360, "height": 740}
STORY = "Write a very long story about a dragon."
HOSTILE = '<script>window.pwned = "script"</script> <img src=x onerror="window.pwned = \'img\'"> [x](javascript:pwned=1)'
MARKDOWN = """| City | Country |
|------|---------|
| Tokyo | Japan |

3. third
4. fourth

```python
def largest(cities):
    return max(cities)
```
"""


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(params=list(VIEWPORTS))
def viewport(request):
    return VIEWPORTS[request.param]


@pytest.fixture
def page(browser, server, viewport):  # noqa: F811
    context = browser.new_context(viewport=viewport)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=f"http://127.0.0.1:{server.port}")
    page = context.new_page()
    page.goto(f"http://127.0.0.1:{server.port}/")
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    yield page
    context.close()


def _settings(page, **fields) -> None:
    """Fill settings fields as a person would: on a phone they are folded away behind Settings."""
    folded = not page.is_visible("#temperature")
    if folded:
        page.click("#menu")
    for name, value in fields.items():
        page.fill(f"#{name}", value)
    if folded:
        page.click("#menu")
        assert not page.is_visible("#temperature")


def _ask(page, question: str, max_tokens: int | str, temperature: str = "0") -> None:
    _settings(page, temperature=temperature, max_tokens=str(max_tokens))
    page.fill("#question", question)
    page.press("#question", "Enter")


def _answers(page) -> list[str]:
    return page.locator(".message.assistant .text").all_inner_texts()


def _stored(page) -> dict:
    return json.loads(page.evaluate(f"localStorage.getItem('{STORE}')") or "null")


def _stored_messages(page) -> list[dict]:
    s = _stored(page)
    return next(c for c in s["conversations"] if c["id"] == s["current"])["messages"]


def _load_with(page, *messages: dict) -> None:
    """Reload the page with one stored conversation holding `messages`."""
    store = {"current": "c1", "settings": {}, "conversations": [
        {"id": "c1", "title": "stored", "system": "", "messages": list(messages)}]}
    page.evaluate("([key, value]) => localStorage.setItem(key, value)", [STORE, json.dumps(store)])
    page.reload()
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)


def _sent(page) -> list[dict]:
    """The bodies of the chat completions the page sends from now on."""
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data))
            if r.url.endswith("/v1/chat/completions") else None)
    return bodies


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def _post_render(server, raw: bytes, method: str = "POST") -> tuple[int, dict]:  # noqa: F811
    conn = server.connection()
    try:
        conn.request(method, "/render", raw, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


# ---- asking, streaming, stopping, reloading ----------------------------------------------
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
    assert _stored_messages(page)[-1]["content"] == sse["text"]
    stats = page.locator(".message.assistant .stats").last.inner_text()
    assert re.search(r"prompt \d+ tokens · \d+ reused · \d+ generated · TTFT [\d.]+ s · [\d.]+ tokens/s", stats), stats


def test_stop_ends_an_answer_mid_way_and_the_server_frees_the_device(page, server):  # noqa: F811
    cancelled = server.log().count("cancelled by client")
    _ask(page, STORY, 400, temperature="0.8")
    page.wait_for_function("document.querySelector('.message.assistant .text').innerText.length > 20",
                           timeout=WAIT_MS)
    page.click("#stop")
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert page.locator(".message.assistant .stats").last.inner_text().startswith("stopped")
    assert not page.is_disabled("#send")
    assert _stored_messages(page)[-1]["stopped"] is True
    deadline = time.monotonic() + 5
    while server.log().count("cancelled by client") == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    line = [l for l in server.log().splitlines() if "cancelled by client" in l][-1]
    assert int(re.search(r"(\d+) generated", line).group(1)) < 400, line


def test_an_answer_stopped_before_any_text_leaves_no_empty_message(page):
    sent = _sent(page)
    _settings(page, temperature="0", max_tokens="4")
    page.fill("#question", "What is the capital of Japan?")
    # Send and Stop in one task: the abort lands before a byte of the answer can.
    page.evaluate("document.getElementById('ask').requestSubmit(); document.getElementById('stop').click()")
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert page.locator(".message.assistant .stats").last.inner_text() == "stopped before any text"
    assert _stored_messages(page) == [{"role": "user", "content": "What is the capital of Japan?"}]
    _ask(page, "And of France?", 4)
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert [m["role"] for m in sent[-1]["messages"]] == ["user", "user"]
    assert all(m["content"].strip() for m in _stored_messages(page))


def test_a_reload_mid_answer_keeps_the_partial_text_and_sends_it_on(page):
    sent = _sent(page)
    _ask(page, STORY, 400)
    page.wait_for_function(f"""(() => {{
      const s = JSON.parse(localStorage.getItem('{STORE}'));
      const m = s.conversations[0].messages;
      return m.length === 2 && m[1].content.length > 40;
    }})()""", timeout=WAIT_MS)
    assert page.get_attribute("body", "data-busy") == "1"      # still streaming
    before = _stored_messages(page)[1]
    assert before["partial"] is True
    page.reload()
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    user, answer = _stored_messages(page)                        # nothing else, nothing empty
    assert user == {"role": "user", "content": STORY}
    assert answer["content"].startswith(before["content"]) and answer.get("partial") is True, {**answer, "content": answer["content"][:80]}
    shown = page.locator(".message.assistant")
    assert shown.count() == 1 and "interrupted" in shown.get_attribute("class")
    assert shown.locator(".stats").inner_text().startswith("interrupted")
    assert _words(shown.locator(".text").inner_text()) == _words(answer["content"])

    _ask(page, "Go on.", 4)
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert sent[-1]["messages"][:2] == [{"role": "user", "content": STORY},
                                        {"role": "assistant", "content": answer["content"]}]
    stored = _stored_messages(page)
    assert stored[1].get("interrupted") is True and "partial" not in stored[1]
    assert all(m["content"].strip() for m in stored)


def test_a_conversation_survives_a_reload_and_markdown_is_escaped(page):
    _ask(page, "Say <b>hi</b> in one word.", 8)
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    answer = _answers(page)[-1]
    page.reload()
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    assert page.locator(".message.user .text").last.inner_text() == "Say <b>hi</b> in one word."
    assert page.locator(".message.user b").count() == 0       # shown as text, never as markup
    assert _answers(page)[-1] == answer
    if not page.is_visible("#conversations"):
        page.click("#menu")
    assert page.locator("#conversations li").count() >= 1
    page.click("#new")
    assert page.locator(".message").count() == 0


def test_an_empty_max_tokens_sends_no_limit(page):
    sent = _sent(page)
    _settings(page, top_p="")                                   # any blank setting is left to the server
    _ask(page, "What is the capital of Japan?", "")
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert "max_tokens" not in sent[-1] and "top_p" not in sent[-1] and sent[-1]["temperature"] == 0
    assert "Tokyo" in _answers(page)[-1]
    page.reload()                                               # the blank setting is kept as such
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    assert page.input_value("#max_tokens") == ""


def test_enter_while_an_input_method_composes_does_not_send(page):
    sent = _sent(page)
    page.fill("#question", "東京")
    page.dispatch_event("#question", "keydown", {"key": "Enter", "isComposing": True})
    assert page.evaluate("""() => {
      const e = new KeyboardEvent('keydown', {key: 'Enter', keyCode: 229, bubbles: true, cancelable: true});
      document.getElementById('question').dispatchEvent(e);
      return e.keyCode;
    }""") == 229
    page.wait_for_timeout(300)
    assert page.input_value("#question") == "東京"
    assert page.locator(".message").count() == 0 and sent == []
    _settings(page, temperature="0", max_tokens="4")           # the same Enter once composition ends sends
    page.dispatch_event("#question", "keydown", {"key": "Enter", "isComposing": False})
    page.wait_for_selector(".message.user", timeout=WAIT_MS)
    page.wait_for_selector("body[data-busy='']", timeout=WAIT_MS)
    assert page.input_value("#question") == "" and sent[-1]["messages"][-1]["content"] == "東京"


# ---- rendering --------------------------------------------------------------------------
def test_markdown_renders_tables_lists_and_highlighted_code_with_a_copy_button(page):
    _load_with(page, {"role": "user", "content": "Show me."}, {"role": "assistant", "content": MARKDOWN})
    answer = page.locator(".message.assistant .text")
    assert answer.locator("table td").all_inner_texts() == ["Tokyo", "Japan"]
    assert answer.locator("ol").get_attribute("start") == "3"
    assert answer.locator("ol li").all_inner_texts() == ["third", "fourth"]
    code = answer.locator("pre code.language-python")
    assert code.locator("span").count() > 5                    # Pygments' tokens...
    colours = page.evaluate("""() => {
      const code = document.querySelector('pre code.language-python');
      return [getComputedStyle(code).color, getComputedStyle(code.querySelector('span.k')).color];
    }""")
    assert colours[0] != colours[1], colours                   # ...coloured by GET /code.css
    page.click(".message.assistant .copy")
    page.wait_for_function("document.querySelector('.copy').textContent === 'Copied'", timeout=WAIT_MS)
    assert page.evaluate("navigator.clipboard.readText()") == "def largest(cities):\n    return max(cities)\n"


def test_model_text_is_never_run_as_html(page):
    _load_with(page, {"role": "user", "content": HOSTILE}, {"role": "assistant", "content": HOSTILE})
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned") is None
    assert page.locator(".message script, .message img").count() == 0
    for text in page.locator(".message .text").all_inner_texts():
        assert '<script>window.pwned = "script"</script>' in text and "<img src=x onerror=" in text
    assert page.locator(".message a[href^='javascript']").count() == 0


def test_the_render_endpoint(server):  # noqa: F811
    status, body = _post_render(server, json.dumps({"text": 'Steps:\n- one\n- **two**\n\n```python\nprint("<x>")\n```'
                                                     }).encode())
    assert status == 200
    html = body["html"]
    assert "<ul>\n<li>one</li>\n<li><strong>two</strong></li>\n</ul>" in html
    assert '<pre><code class="language-python"><span class="nb">print</span>' in html and "&lt;x&gt;" in html
    _, body = _post_render(server, json.dumps({"text": MARKDOWN}).encode())
    assert "<table>" in body["html"] and '<ol start="3">' in body["html"]
    _, body = _post_render(server, json.dumps({"text": HOSTILE + " ![t](http://example.com/t.png)"}).encode())
    assert "<script" not in body["html"] and "<img" not in body["html"] and 'href="javascript' not in body["html"]
    assert '<a href="http://example.com/t.png"' in body["html"]  # an image is a link, never fetched

    for raw, status, param in [(b"not json", 400, None), (b'["text"]', 400, None), (b'{"text": 5}', 400, "text"),
                               (b'{}', 400, "text"),
                               (json.dumps({"text": "x" * ((1 << 20) + 1)}).encode(), 413, "text")]:
        got, body = _post_render(server, raw)
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, (raw[:20], body)
        assert body["error"]["param"] == param
    assert _post_render(server, b"", method="GET")[0] == 405
    assert "refused: 413 text_too_long" in server.log()


# ---- layout -----------------------------------------------------------------------------
def test_long_unbroken_strings_do_not_widen_the_page(page):
    long = "x" * 4000
    wide_table = "| " + " | ".join(f"column{i}" for i in range(40)) + " |\n|" + "---|" * 40 + "\n"
    _load_with(page, {"role": "user", "content": long},
               {"role": "assistant", "content": f"{long}\n\nhttps://example.com/{long}\n\n`{long}`\n\n{wide_table}\n"
                                                f"```\n{long}\n```\n"})
    page.fill("#question", long)
    sizes = page.evaluate("""() => ({
      page: document.scrollingElement.scrollWidth, messages: document.getElementById('messages').scrollWidth,
      messagesBox: document.getElementById('messages').clientWidth, width: innerWidth,
      right: Math.max(...[...document.querySelectorAll('.message, #ask')].map((e) => e.getBoundingClientRect().right)),
    })""")
    assert sizes["page"] <= sizes["width"] and sizes["right"] <= sizes["width"], sizes
    assert sizes["messages"] <= sizes["messagesBox"], sizes
    assert page.locator(".message.assistant table").count() == 1   # wide parts scroll in their own box


def _in_view(page, selector: str) -> bool:
    return page.evaluate("""(sel) => {
      const r = document.querySelector(sel).getBoundingClientRect();
      return r.left >= 0 && r.top >= 0 && r.right <= innerWidth && r.bottom <= innerHeight &&
             document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2).closest(sel) !== null;
    }""", selector)


def test_send_and_stop_are_on_screen_and_settings_fold_away_on_a_phone(page, viewport):
    assert _in_view(page, "#send") and _in_view(page, "#stop") and _in_view(page, "#question")
    assert page.evaluate("document.scrollingElement.scrollWidth") <= viewport["width"]
    if viewport["width"] >= 800:
        assert page.is_visible("#temperature") and not page.is_visible("#menu")
        return
    assert not page.is_visible("#temperature") and page.get_attribute("#menu", "aria-expanded") == "false"
    page.click("#menu")
    assert page.is_visible("#temperature") and page.is_visible("#new")
    assert page.get_attribute("#menu", "aria-expanded") == "true" and _in_view(page, "#send")


def test_the_narrowest_phone_still_fits(browser, server):  # noqa: F811
    context = browser.new_context(viewport=NARROWEST)
    try:
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{server.port}/")
        page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
        assert _in_view(page, "#send") and _in_view(page, "#stop") and _in_view(page, "#menu")
        assert page.evaluate("document.scrollingElement.scrollWidth") <= NARROWEST["width"]
    finally:
        context.close()
