"""Child process under llama.cpp's own interpreter: a GGUF requantized to a 4-bit type by llama.cpp.

The converter in the sdist writes float and 8-bit types only; the 4-bit types come from
llama.cpp's quantizer (`llama_model_quantize`, the function its `llama-quantize` tool calls),
reached through llama-cpp-python's bindings so that no separate tool has to be built. Its
defaults are kept, as a user running `llama-quantize model.gguf out.gguf Q4_K_M` would get them:
the k-quant mixtures, and the output (or tied embedding) tensor at the type llama.cpp picks.

Standard library and llama_cpp only, like every module this interpreter runs.
"""
from __future__ import annotations

import ctypes
import os
import sys

# The bench's names for llama.cpp's 4-bit file types (`llama_ftype`).
FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[2] not in FTYPES:
        print(f"usage: python -m bench.llamacpp_quantize IN.gguf OUT.gguf {{{','.join(FTYPES)}}}", file=sys.stderr)
        return 2
    import llama_cpp

    src, out, kind = argv
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize({kind}) returned {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
