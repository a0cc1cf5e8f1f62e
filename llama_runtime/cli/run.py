"""Command line of `llama32_1b_inference.py` (`make run`, `make chat`): one prompt, or an interactive chat.

Stop strings (`--stop`) and a JSON schema the answer must follow (`--json-schema`, `--json`)
go through the same generation layer as the server's `stop` and `response_format`. Errors a
user can cause print one line (`error: ...`) and exit 2, a bad schema before any loading;
`--verbose` adds the traceback. Ctrl-C stops the current answer; in chat the conversation
stays usable.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from llama_base.errors import PromptError, UserError
from llama_runtime.cli.options import OneLineParser, add_model_options, positive_int, user_error
from llama_runtime.generation.constrained import ANY_OBJECT, Constraint, Grammars, json_grammar
from llama_runtime.generation.sampling import SamplingParams
from llama_runtime.generation.session import GenerationResult, Session, build_session


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="llama32_1b_inference.py",
                      description="Llama-3.2-1B on the AMD NPU2 (or the simulated NPU) through MLIR-AIR.")
    p.add_argument("--prompt", "-p", help="prompt text; '-' reads it from standard input")
    add_model_options(p, max_context=True, decode=True, threads=True)
    p.add_argument("--n-tokens", "-n", type=positive_int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--system", help="system prompt for chat models")
    p.add_argument("--raw", action="store_true", help="no chat template, even for instruct models")
    p.add_argument("--interactive", "-i", action="store_true", help="chat: /reset, /quit, Ctrl-D to leave")
    p.add_argument("--profile", action="store_true", help="print a per-call timing breakdown")
    p.add_argument("--compile-only", action="store_true", help="compile every kernel group into the cache and stop")
    p.add_argument("--run-only", action="store_true", help="never compile; fail if the kernel cache lacks a group")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer where its text first shows TEXT (repeatable)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE_OR_JSON",
                       help="the answer must be a JSON document this schema accepts (a file, or the schema itself)")
    shape.add_argument("--json", action="store_true", help="the answer must be a JSON object")
    p.add_argument("--verbose", "-v", action="store_true", help="tracebacks on errors")
    return p


def _read_prompt(args) -> str:
    if args.prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptError(f"standard input is not valid UTF-8 (byte {e.start})") from None
    if args.prompt is None:
        raise PromptError("no prompt: pass --prompt TEXT (or --interactive)")
    return args.prompt


def _grammar(args) -> tuple[str, str] | None:
    """The grammar `--json-schema` or `--json` asks for, and the flag it came from; checked
    here, before the model loads."""
    if args.json:
        return json_grammar(ANY_OBJECT, "--json"), "--json"
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PromptError(f"--json-schema: {text!r} is neither a JSON object nor a readable file "
                              f"({getattr(e, 'strerror', None) or e})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptError(f"--json-schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise PromptError(f"--json-schema must be a JSON object (a schema), got {type(schema).__name__}")
    return json_grammar(schema, "--json-schema"), "--json-schema"


def _summary(r: GenerationResult) -> str:
    why = {"end_token": "end of answer", "n_tokens": "token budget reached", "context_limit": "context limit reached",
           "interrupted": "interrupted", "cancelled": "cancelled",
           "stop_string": f"stop string {json.dumps(r.stop_string)}"}[r.stop_reason]
    return (f"[stats] prompt {r.prompt_tokens} tokens, TTFT {r.ttft_s:.3f} s, {len(r.tokens)} tokens at "
            f"{r.decode_tokens_per_s:.2f} tok/s, stopped: {why}")


def _chat(session: Session, args: argparse.Namespace, sampling: SamplingParams,
          constraint: Callable[[], Constraint | None]) -> None:
    from llama_runtime.generation.chat import Conversation

    conv = Conversation(session, system=args.system)
    print("[chat] /reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops an answer.", flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        cmd = line.strip()
        if cmd in ("/quit", "/exit"):
            return
        if cmd == "/reset":
            conv.reset()
            print("[chat] conversation cleared", flush=True)
            continue
        if not cmd:
            continue
        print("assistant> ", end="", flush=True)
        try:
            r = conv.ask(line, args.n_tokens, lambda t: print(t, end="", flush=True), sampling,
                         stop=tuple(args.stop), constraint=constraint())
        except KeyboardInterrupt:
            print("\n[chat] stopped", flush=True)
            continue
        except UserError as e:
            print(f"\nerror: {e}", flush=True)
            continue
        for note in conv.notices:
            print(f"\n[chat] {note}", flush=True)
        conv.notices.clear()
        print(f"\n{_summary(r)}", flush=True)


def run_cli(argv: list[str] | None = None) -> int:
    """`make run` / `make chat`: parse, build the session, answer or chat; the exit status."""
    args = parser().parse_args(argv)
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
        prompt = None if (args.interactive or args.compile_only) else _read_prompt(args)
        if prompt is not None and not prompt.strip():
            raise PromptError("the prompt is empty")
        grammar = _grammar(args)
        session = build_session(args.model, args.device, args.max_context, profile=args.profile,
                                allow_compile=not args.run_only, chat=False if args.raw else None, quant=args.quant,
                                decode=args.decode, threads=args.threads)
        print(f"[decode] {session.model.describe_decode()}", flush=True)
        k = session.kc.stats
        print(f"[kernels] {len(session.model.all_groups())} groups: {k.compiled} compiled, "
              f"{k.loaded_from_disk} from cache ({session.kc.dir}); ready in {session.build_s:.1f} s", flush=True)
        if args.compile_only:
            return 0
        grammars = Grammars(session.tokenizer)

        def constraint() -> Constraint | None:        # each answer follows the grammar afresh
            return None if grammar is None else grammars.for_grammar(*grammar)

        if args.interactive:
            _chat(session, args, sampling, constraint)
            return 0
        session.profiler.reset()
        ids = session.encode(prompt, system=args.system)
        r = session.generate(ids, args.n_tokens, lambda t: print(t, end="", flush=True), sampling,
                             constraint=constraint(), stop=tuple(args.stop))
        print()
        print(_summary(r), flush=True)
        if args.profile:
            from llama_runtime.cli.profile_report import report

            print(report(session, r))
        return 130 if r.stop_reason == "interrupted" else 0
    except UserError as e:
        return user_error(e, args.verbose)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
