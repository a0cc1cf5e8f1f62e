"""The server while its model loads: the port answers from the first second, so a front end
that starts the server and polls `GET /health` sees "loading" (503) instead of a refused
connection it cannot tell from a crash, and a request sent too early gets an error in its own
API's format with a Retry-After instead of hanging for the minute a load can take.

`Gate` is the ASGI app uvicorn serves from the start; `open()` hands every later request to
the real app (app.py) once the worker exists. Nothing else changes at that moment: the
requests that were refused are simply retried by their clients.
"""
from __future__ import annotations

import html

from starlette.responses import HTMLResponse, JSONResponse, Response

from llama_runtime.serve import ollama
from llama_runtime.serve.openai_request import ApiError

RETRY_AFTER_S = 2           # a load takes seconds to a minute; a short poll interval is cheap


class Gate:
    """503 "loading" for every request until `open(app)`, then that app for every request."""

    def __init__(self, model_id: str, device_name: str):
        self.model_id, self.device_name = model_id, device_name
        self.app = None

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        app = self.app
        if app is not None:
            await app(scope, receive, send)
        elif scope["type"] == "http":
            await self.loading(scope["path"])(scope, receive, send)

    def loading(self, path: str) -> Response:
        """The answer while loading, in the format the route's clients read."""
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        message = f"the model '{self.model_id}' is loading; retry when GET /health answers 200"
        if path == "/health":
            return JSONResponse({"status": "loading", "model": self.model_id, "device": self.device_name},
                                status_code=503, headers=headers)
        if path.startswith(ollama.PREFIX):         # Ollama's clients read {"error": "..."}
            return JSONResponse({"error": message}, status_code=503, headers=headers)
        if path == "/":             # the chat page: reload until the model is there
            return HTMLResponse(f'<!doctype html><meta http-equiv="refresh" content="{RETRY_AFTER_S}">'
                                f"<title>Loading</title><p>{html.escape(message)}.</p>", status_code=503,
                                headers=headers)
        error = ApiError(503, message, None, "model_loading", "server_error", headers)
        return JSONResponse(error.body(), status_code=503, headers=headers)

