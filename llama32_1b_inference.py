"""`make run`, `make chat`, `make serve`: the command line over `llama_runtime.generation.session`.

The runtime itself (`Session`, `build_session`, `generate`) lives in the package; this file is
the entry point the layout names, and its names are those the package's callers import.
"""
from __future__ import annotations

import sys

from llama_runtime.engine.kv_cache import DEFAULT_MAX_CONTEXT
from llama_runtime.generation.session import GenerationResult, Session, build_session, is_chat_model

__all__ = ["DEFAULT_MAX_CONTEXT", "GenerationResult", "Session", "build_session", "is_chat_model", "main"]


def main(argv: list[str] | None = None) -> int:
    """`--serve` first runs the HTTP server (imported only then, so `make run` never loads the
    web stack); anything else is the prompt and chat command line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        from llama_runtime.cli.serve import serve

        return serve(argv[1:])
    from llama_runtime.cli.run import run_cli

    return run_cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
