"""The flags every command line shares, defined once: which model, on which device, in which
weight format, with how much context; and how a command reports a user's mistake.

`make run`, `make serve`, `make compile`, `verify`, `verify.mlir`, the mutants, perplexity and
the bench all take them, so a new model alias, device or format appears in every one at once.
"""
from __future__ import annotations

import argparse
import sys
import traceback

from llama_base.errors import UserError
from llama_base.weight_formats import QUANTS
from llama_runtime.engine.device_model import DECODE_MODES
from llama_runtime.engine.kv_cache import DEFAULT_MAX_CONTEXT
from npu_runtime.devices import DEVICE_KINDS

MODEL_HELP = ("instruct | base | embedded | llama1b-shape | llama3b-shape | llama8b-shape | tiny | tiny-hd128 | "
              "a local folder | a .gguf file | a HF repo id (default: %(default)s)")
DEVICE_HELP = "where the model runs (default: %(default)s)"
QUANT_HELP = ("weight format: bf16, or q4nx (4-bit, made from the checkpoint on first use and cached; "
              "default: %(default)s)")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {v}")
    return v


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit 2) rather than usage plus the error."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def add_model_options(p: argparse.ArgumentParser, *, model: str | None = "instruct", model_help: str = MODEL_HELP,
                      device: str = "auto", devices: tuple[str, ...] = DEVICE_KINDS, device_help: str = DEVICE_HELP,
                      quant: str = "bf16", quant_help: str = QUANT_HELP, max_context: bool = False,
                      decode: bool = False, threads: bool = False,
                      without: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """`--model`, `--device`, `--quant` (and `--max-context`, `--decode`, `--threads`) as every command spells them, with
    the command's own defaults, device choices and help; `without` names the flags a command
    has no use for (`"model"`, `"device"`, `"quant"`: no device to choose, or a list of models
    or formats it spells its own way)."""
    unknown = set(without) - {"model", "device", "quant"}
    if unknown:
        raise ValueError(f"add_model_options: no flag {', '.join(sorted(unknown))}")
    if "model" not in without:
        p.add_argument("--model", "-m", default=model, help=model_help)
    if "device" not in without:
        p.add_argument("--device", choices=devices, default=device, help=device_help)
    if "quant" not in without:
        p.add_argument("--quant", choices=QUANTS, default=quant, help=quant_help)
    if max_context:
        p.add_argument("--max-context", type=positive_int,
                       help=f"KV cache length in positions (default {DEFAULT_MAX_CONTEXT}; at most the model's limit, "
                            "and only where its KV cache fits in the memory available)")
    if decode:
        p.add_argument("--decode", choices=("auto",) + DECODE_MODES, default="auto",
                       help="layers: 2 device calls a layer, the KV cache and attention on the host (the design "
                            "card's); fused: 1 call a token, the KV cache and attention on the device; auto: "
                            "the faster on this device (default)")
    if threads:
        p.add_argument("--threads", type=positive_int,
                       help="host threads for the CPU kernels, fixed (default: the cores other processes leave "
                            "free, measured as it runs)")
    return p


def user_error(e: UserError, verbose: bool) -> int:
    """One `error:` line (the traceback too with --verbose); the exit status of bad input."""
    if verbose:
        traceback.print_exc()
    print(f"error: {e}", file=sys.stderr)
    return 2
