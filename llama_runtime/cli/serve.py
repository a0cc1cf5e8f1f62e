"""`make serve`'s command line: parse, bind the port, build the session, serve until Ctrl-C.

The port is bound and the device opened before the model loads, so a taken port or a missing
NPU fails in a second, not after the load; the port then answers while the model loads
(loading.Gate). The app itself is `llama_runtime.serve.app`.
"""
from __future__ import annotations

import os
import socket

from llama_base.errors import UserError
from llama_runtime.cli.options import OneLineParser, add_model_options, positive_int, user_error
from llama_runtime.generation.session import build_session
from llama_runtime.serve import app
from npu_runtime.devices import open_device
from llama_runtime.serve.worker import DEFAULT_QUEUE_SIZE, Worker


def parser() -> OneLineParser:
    p = OneLineParser(prog="llama32_1b_inference.py --serve",
                      description="HTTP server for one model on one device: OpenAI's API under /v1 (models, "
                                  "chat/completions, completions, embeddings), Ollama's under /api, /health, "
                                  "/tokenize, /detokenize, /metrics, and a chat page at /.")
    add_model_options(p, max_context=True, decode=True, threads=True)
    p.add_argument("--host", default=app.DEFAULT_HOST, help=f"address to listen on (default {app.DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=app.DEFAULT_PORT,
                   help=f"TCP port (default {app.DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--queue-size", type=positive_int, default=DEFAULT_QUEUE_SIZE,
                   help=f"requests that may wait for the model; more get 503 (default {DEFAULT_QUEUE_SIZE})")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (scheme://host[:port]) whose pages may call the API from a browser; "
                        "repeat for several, '*' for any (default: none)")
    p.add_argument("--run-only", action="store_true", help="never compile; fail if the kernel cache lacks a group")
    p.add_argument("--verbose", "-v", action="store_true", help="tracebacks on errors")
    return p


def _listen(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen()           # connections wait in the backlog for uvicorn, never refused
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def serve(argv: list[str] | None = None) -> int:
    """`make serve`: the exit status."""
    args = parser().parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    sock = None
    try:
        sock = _listen(args.host, args.port)
        device = open_device(args.device, verbose=True)     # a missing NPU fails before anything loads
    except (UserError, KeyboardInterrupt) as e:
        if sock is not None:
            sock.close()
        return 130 if isinstance(e, KeyboardInterrupt) else user_error(e, args.verbose)
    host, port = sock.getsockname()[:2]

    def load() -> Worker:
        session = build_session(args.model, device, args.max_context, allow_compile=not args.run_only, log=log,
                                quant=args.quant, decode=args.decode, threads=args.threads)
        worker = Worker(session, args.queue_size, log=log)
        log(f"[serve] model '{session.resolved.name}' on {type(device).__name__}, context {worker.max_context}, "
            f"queue {args.queue_size}; ready in {session.build_s:.1f} s")
        log(f"[decode] {session.model.describe_decode()}")
        log(f"[serve] OpenAI-compatible API at http://{host}:{port}/v1, chat page at http://{host}:{port}/ "
            "(Ctrl-C stops)")
        return worker

    log(f"[serve] listening on http://{host}:{port} while the model loads (GET /health: 503 loading, then 200)")
    try:
        app.run(sock, args.model or "instruct", device.name, load, args.cors_origin, log)
    except UserError as e:
        return user_error(e, args.verbose)
    except app.StoppedWhileLoading:
        log("[serve] stopped while loading")
        os._exit(130)           # the load's thread may be inside torch or a compiler; nothing of it is kept
    finally:
        sock.close()
    log("[serve] stopped")
    return 0
