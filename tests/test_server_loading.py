"""The server before its model is there: the port answers "loading" in each API's own format,
hands over to the real app once it is set, and a load that fails or is interrupted ends the
process with one line instead of a served port that never becomes ready."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from llama_runtime.serve.loading import RETRY_AFTER_S, Gate

REPO = Path(__file__).resolve().parents[1]
LISTEN_TIMEOUT_S = 120          # imports on a busy machine; the load itself is not waited for
EXIT_TIMEOUT_S = 20


def _gate() -> tuple[Gate, TestClient]:
    gate = Gate("instruct", "simulated NPU2")
    return gate, TestClient(gate)


def test_health_says_loading_with_the_model_and_device_asked_for():
    _, client = _gate()
    r = client.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
    assert r.json() == {"status": "loading", "model": "instruct", "device": "simulated NPU2"}


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/embeddings", "openai"),
                                         ("/api/chat", "ollama"), ("/api/tags", "ollama")])
def test_early_requests_get_a_503_their_client_reads(path, shape):
    _, client = _gate()
    r = client.post(path, json={"model": "instruct"}) if path != "/api/tags" else client.get(path)
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    body = r.json()
    if shape == "openai":
        assert body["error"]["code"] == "model_loading" and "loading" in body["error"]["message"]
    else:
        assert isinstance(body["error"], str) and "loading" in body["error"]


def test_the_chat_page_reloads_itself_until_the_model_is_there():
    _, client = _gate()
    r = client.get("/")
    assert r.status_code == 503 and 'http-equiv="refresh"' in r.text and "&#x27;instruct&#x27;" in r.text


def test_once_opened_every_request_goes_to_the_app():
    gate, client = _gate()
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("app"))])
    gate.open(app)
    r = client.get("/health")
    assert r.status_code == 200 and r.text == "app"
    assert client.get("/v1/models").status_code == 404       # the app's own answer, not "loading"


# ---- the process ----------------------------------------------------------------------
def _serve(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(REPO / "llama32_1b_inference.py"), "--serve", "--device", "sim",
                             "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    for line in proc.stdout:
        if m := re.search(r"listening on http://[^:]+:(\d+)", line):
            return proc, int(m.group(1))
        assert time.monotonic() < deadline, "the server did not listen"
    raise AssertionError(f"the server exited before listening (status {proc.wait()})")


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_load_that_fails_ends_the_server_with_one_error_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")     # a folder that is no checkpoint
    proc, _ = _serve("--model", str(tmp_path))
    out = proc.stdout.read()
    assert proc.wait(timeout=EXIT_TIMEOUT_S) == 2
    errors = [l for l in out.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out and "OpenAI-compatible API at" not in out


def test_ctrl_c_while_loading_stops_at_once():
    proc, port = _serve("--model", "embedded")
    status, body = _health(port)
    assert (status, body["status"]) == (503, "loading")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=EXIT_TIMEOUT_S) == 130
    out = proc.stdout.read()
    assert "[serve] stopped while loading" in out and "Traceback" not in out
