"""The chat page (GET /) and what it needs from the server: one HTML file shipped as package
data, served by the runtime itself, so it works offline.

Markdown is rendered here, on the server, rather than in the browser. The page must fetch
nothing from elsewhere and the repository carries no third-party code copied by hand, so a
JavaScript renderer would have to come from a Python package that happens to ship one;
markdown-it-py (CommonMark, MIT) and Pygments (BSD) are ordinary pinned dependencies
instead, kept up by their projects. Rendering with `html=False` is what keeps model output
from ever running in the page: raw HTML in the text comes out escaped, and markdown-it's link
validation refuses `javascript:`-style URLs, so the page can insert the result as it is with
no sanitizer of its own. The cost is a round trip per render; the page throttles them while an
answer streams and shows the raw text, escaped, until the first one arrives.

Successful renders are not logged: the page asks for several a second while an answer
streams, and a line each would bury the completions' lines. Refusals are logged by the app's
handler like any other.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from llama_runtime.serve.openai_request import ApiError, json_object

CHAT_PAGE = resources.files("llama_runtime.serve") / "web" / "chat.html"
MAX_TEXT_BYTES = 1 << 20           # far beyond any answer that fits the model's context
# JSON may spell one byte of text as six (\u00XX), so the body's cap is wider than the text's.
MAX_BODY_BYTES = 6 * MAX_TEXT_BYTES + (64 << 10)
CODE_STYLE = "github-dark"         # dark, as the page's code blocks are
CODE_SCOPE = ".text pre"           # where the page shows rendered answers' code


def _highlight(code: str, lang: str, _attrs) -> str:
    """Pygments' spans for a fence that names a language it knows; "" lets markdown-it escape
    the rest as plain code. No guessing for unnamed fences: a wrong guess colours prose."""
    try:
        lexer = get_lexer_by_name(lang) if lang else None
    except ClassNotFound:
        lexer = None
    return highlight(code, lexer, HtmlFormatter(nowrap=True)) if lexer else ""


def _image_as_link(self, tokens, idx, options, env) -> str:
    """An image in an answer becomes a link to it: loading it would fetch from wherever the
    model pointed, which can carry the conversation out in its URL."""
    token = tokens[idx]
    alt = self.renderInlineAsText(token.children or [], options, env) or token.attrGet("src")
    return f'<a href="{escapeHtml(token.attrGet("src") or "")}" rel="noopener noreferrer" target="_blank">' \
           f'{escapeHtml(alt)}</a>'


def _link_open(self, tokens, idx, options, env) -> str:
    """Links open elsewhere, so following one does not leave a streaming answer."""
    tokens[idx].attrSet("target", "_blank")
    tokens[idx].attrSet("rel", "noopener noreferrer")
    return self.renderToken(tokens, idx, options, env)


@lru_cache(maxsize=1)
def markdown() -> MarkdownIt:
    # CommonMark plus GitHub's tables and strikethrough, which models write. `breaks`: a model's
    # single newlines are meant as line breaks (poems, addresses), not as spaces.
    md = MarkdownIt("commonmark", {"html": False, "breaks": True, "highlight": _highlight})
    md.enable(["table", "strikethrough"])
    md.add_render_rule("image", _image_as_link)
    md.add_render_rule("link_open", _link_open)
    return md


def render(text: str) -> str:
    return markdown().render(text)


@lru_cache(maxsize=1)
def code_css() -> str:
    """The style's colours for the spans `_highlight` writes; its other rules (line numbers, a
    bare `pre`) are for markup the page does not have, and would reach past its code blocks."""
    rules = HtmlFormatter(style=CODE_STYLE).get_style_defs(CODE_SCOPE).splitlines()
    return "\n".join(r for r in rules if r.startswith(CODE_SCOPE)) + "\n"


async def _capped_body(request: Request) -> bytes:
    too_large = ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", None, "request_too_large")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _render_text(request: Request) -> str:
    body = json_object(await _capped_body(request))
    text = body.get("text")
    if not isinstance(text, str):
        raise ApiError(400, f"'text' is required and must be a string, got {json.dumps(text)[:40]}", "text")
    encoded = text.encode("utf-8", "replace")     # a lone surrogate (JSON allows one) becomes "?"
    if len(encoded) > MAX_TEXT_BYTES:
        raise ApiError(413, f"'text' is over {MAX_TEXT_BYTES} bytes", "text", "text_too_long")
    return encoded.decode("utf-8")


def routes(api) -> list[Route]:
    """The page's routes, bound to the app's `Api` (its log line)."""

    async def chat_page(request: Request):
        api._served(request)
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-cache"})

    async def code_style(request: Request):
        api._served(request)
        return Response(code_css(), media_type="text/css", headers={"Cache-Control": "no-cache"})

    async def render_markdown(request: Request):
        text = await _render_text(request)
        # A long answer takes a while to highlight: off the event loop, which streams the tokens.
        return JSONResponse({"html": await run_in_threadpool(render, text)})

    return [Route("/", chat_page, methods=["GET"]),
            Route("/code.css", code_style, methods=["GET"]),
            Route("/render", render_markdown, methods=["POST"])]
