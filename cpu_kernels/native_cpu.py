"""Native host kernels that make the simulated NPU fast where torch is slow: the bf16 GEMV
(memory-bound instead of compute-bound) and GEMM, both on weights in the device's packed tiles
(`weight_tiles`), the decode-sized elementwise launches, the host's single-query attention
(one pass instead of several dispatched ops with temporaries) and prefill's causal attention
(flash-style tiles on the launch's own layouts).

One source per kernel, compiled once per ISA class (`ISAS`: AMX-BF16 tiles for prefill's GEMM
over the AVX512-BF16 kernels, as on Intel Xeons since Sapphire Rapids; AVX512-BF16; AVX-512 with
its bf16 products in FMAs, for CPUs without AVX512-BF16 or whose vdpbf16ps is slow
(`dot_class`); or AVX2 with FMA for CPUs without AVX-512, such as AMD Zen 3 and most Intel
client CPUs) with the system C++
compiler on first use, into the cache (keyed by the source hash and flags), and loaded with
ctypes. The best class this CPU runs is picked once, by each library's own probe
(`__builtin_cpu_supports`, and for AMX the kernel's permission); `LLAMA_NPU_ISA` forces a lower
one, or `torch` (no native library; `LLAMA_NPU_NATIVE=0` is the same). `amx-emulated` runs the
AMX GEMM on any AVX2 CPU with the tile instructions emulated as specified (`EMULATIONS`), about
4x slower than the `avx512bf16` GEMM, for testing that path where no AMX CPU is at hand. The
library is parallel with OpenMP and binds to the runtime torch has already loaded (torch is
imported first), so both share one thread team and torch's `set_num_threads` governs both.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from functools import partial
from typing import Callable, Iterator

import torch

from llama_base import q4nx
from llama_base.errors import UserError
from cpu_kernels import dot_class
from cpu_kernels.native_build import (ALL_CLASSES, CPU_FLAGS, EMULATIONS, INTEGER_Q4NX_GEMM, ISAS, TILE_CLASSES,
                                      activation_bytes, cpu_flags, library_path)

TORCH = "torch"                 # no native library: the simulator's torch bodies
ENV_ISA = "LLAMA_NPU_ISA"
ENV_AHEAD = "LLAMA_NPU_STREAM_AHEAD"   # bytes the decode GEMVs prefetch ahead, for comparisons
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_forced: str | None = None      # use_isa's choice, over the environment's
_probed: dict[str, ctypes.CDLL | None] = {}


class IsaError(UserError):
    """An ISA class asked for that this CPU or build cannot run."""


def _worth_building(isa: str) -> bool:
    """False only where /proc/cpuinfo shows the CPU lacks what `isa` needs (CPU_FLAGS) and the
    class was not asked for by name: no compile for a class whose probe would say no. A kernel
    older than a flag (Linux lists `avx512_bf16` from 5.x) leaves it out on a CPU that has it,
    so a class asked for is built all the same, and there too the library's probe decides."""
    need = CPU_FLAGS.get(isa)
    if not need or isa in (_forced, _env_isa()):
        return True
    have = cpu_flags()
    return have is None or need <= have


def _open(isa: str) -> ctypes.CDLL | None:
    """The library for `isa` if it builds and this CPU runs it (asked of the library itself, whose
    probe executes no instruction of its ISA), probed once per process."""
    if isa not in _probed:
        lib = None
        path = library_path(isa) if _worth_building(isa) else None
        if path is not None:
            try:
                cand = ctypes.CDLL(str(path))
                cand.native_cpu_isa.restype = ctypes.c_char_p
                if cand.native_cpu_isa().decode() == isa and cand.native_cpu_isa_supported():
                    lib = cand
            except OSError:
                lib = None
        _probed[isa] = lib
    return _probed[isa]


def supported_isas() -> list[str]:
    """The native ISA classes this CPU (and compiler) can run, best first; without `torch` and
    the emulations."""
    return [isa for isa in ISAS if _open(isa) is not None]


def emulated_isas() -> list[str]:
    """The emulations (`native_build.EMULATIONS`) this CPU can run."""
    return [isa for isa in EMULATIONS if _open(isa) is not None]


def runnable(isa: str) -> bool:
    """Whether class `isa` (an emulation included) builds and runs on this CPU."""
    return isa in ALL_CLASSES and _open(isa) is not None


def tiled(isa: str) -> bool:
    """Whether class `isa` runs prefill's GEMM on (real or emulated) AMX tiles, which sum in
    another order than the vector GEMM: its GEMM results are not the vector classes' bits."""
    return isa in TILE_CLASSES


def _env_isa() -> str:
    """LLAMA_NPU_ISA as written, normalized; "" where it is unset."""
    return os.environ.get(ENV_ISA, "").strip().lower()


def _requested() -> str | None:
    """The class asked for (use_isa, then LLAMA_NPU_ISA, then LLAMA_NPU_NATIVE=0), None for the best."""
    if _forced is not None:
        return _forced
    want = _env_isa()
    if want:
        if want not in (*ALL_CLASSES, TORCH):
            raise IsaError(f"{ENV_ISA}={want!r}: expected one of {', '.join([*ALL_CLASSES, TORCH])}")
        return want
    return TORCH if os.environ.get("LLAMA_NPU_NATIVE", "1") == "0" else None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pack_weight_bf16_cpu_plan.argtypes = [ptr, i64, i64, ctypes.POINTER(i64)]
    lib.pack_weight_bf16_cpu_plan.restype = i64
    lib.pack_weight_bf16_cpu.argtypes = [ptr, i64, i64, i64, ptr]
    lib.matmul_bf16_cpu_tile_rows.restype = i64
    lib.tile_rows = lib.matmul_bf16_cpu_tile_rows()
    lib.matmul_bf16_cpu_packed_header.restype = i64
    lib.packed_header = lib.matmul_bf16_cpu_packed_header()
    lib.attention_bf16_cpu_max_head_dim.restype = i64
    lib.max_head_dim = lib.attention_bf16_cpu_max_head_dim()
    lib.flash_attention_bf16_cpu.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.flash_attention_bf16_cpu_max_head_dim.restype = i64
    lib.flash_max_head_dim = lib.flash_attention_bf16_cpu_max_head_dim()
    lib.resident_kv_bf16_cpu_max_head_dim.restype = i64
    lib.resident_max_head_dim = lib.resident_kv_bf16_cpu_max_head_dim()
    lib.tiles_dot_bf16_cpu.argtypes = [ptr, ptr, ptr]
    lib.read_rows_cpu.argtypes = [ctypes.c_int, i64, i64, i64, ptr, i64, ptr]
    lib.read_rows_cpu.restype = i64
    lib.read_rows_cached_cpu.argtypes = [ctypes.c_int, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr]
    lib.read_rows_cached_cpu.restype = i64
    lib.top_k_ids_cpu.argtypes = [ptr, i64, i64, ptr]
    lib.rows_dot_bf16_cpu.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.rescore_rows_cpu.argtypes = [ptr, ptr, i64, i64, ptr, i64, ctypes.c_int, i64, i64, ptr, ptr, ptr, ptr, ptr,
                                     ptr, i64, ptr]
    lib.rescore_rows_cpu.restype = i64
    lib.stream_ahead_set.argtypes = [i64]
    lib.native_hold_thread.argtypes = [ctypes.c_int]
    lib.native_taken.argtypes, lib.native_taken.restype = [ctypes.c_int], i64
    lib.native_program_max_args.restype = i64
    lib.replayed = replayed_functions(lib)
    for name, (_, kinds) in lib.replayed.items():
        getattr(lib, name).argtypes = [ARG_TYPES[k] for k in kinds]
    lib.native_program_run.argtypes = [ptr, i64, i64, ptr]
    lib.native_program_run.restype = i64
    lib.stream_ahead_bytes.restype = i64
    lib.stream_hint_set.argtypes = [ctypes.c_int]
    lib.stream_ahead_set(ahead_from_env())
    lib.isa = lib.native_cpu_isa().decode()
    return lib


# The argument kinds of a replayed function as program_cpu.cc spells them (its `Kind`).
ARG_TYPES = {"p": ctypes.c_void_p, "q": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}


def replayed_functions(lib: ctypes.CDLL) -> dict[str, tuple[int, str]]:
    """The functions a native program may replay, as the library's table lists them: name ->
    (code, argument kinds, one letter of `ARG_TYPES` each). program_cpu.cc derives the table
    from the functions' prototypes (native/replayed.h), and `_bind` their `argtypes` from it:
    the one declaration of those signatures is the C++ one. A kind this module cannot pass is
    a library built from other sources than this module, refused at load."""
    lib.native_program_function.argtypes = lib.native_program_signature.argtypes = [ctypes.c_int64]
    lib.native_program_function.restype = lib.native_program_signature.restype = ctypes.c_char_p
    out: dict[str, tuple[int, str]] = {}
    while name := lib.native_program_function(len(out)).decode():
        kinds = lib.native_program_signature(len(out)).decode()
        unknown = sorted(set(kinds) - set(ARG_TYPES))
        if unknown:
            raise RuntimeError(f"native library: {name}({kinds}) takes argument kinds {unknown} that "
                               f"native_cpu.ARG_TYPES does not know (a library from other sources)")
        out[name] = (len(out), kinds)
    return out


def ahead_from_env() -> int:
    """LLAMA_NPU_STREAM_AHEAD as bytes; 0 (the library's default) where it is unset."""
    want = os.environ.get(ENV_AHEAD, "").strip()
    if not want:
        return 0
    if not want.isdigit() or int(want) == 0:
        raise IsaError(f"{ENV_AHEAD}={want!r}: expected a positive number of bytes")
    return int(want)


def _choose() -> ctypes.CDLL | None:
    want = _requested()
    if want == TORCH:
        return None
    if want is None:                       # the best this CPU runs (building no other), else torch
        lib = next((lib for lib in map(_open, ISAS) if lib is not None), None)
        if lib is None:
            return None
        rival = _open(dot_class.RIVALS[1]) if lib is _open(dot_class.RIVALS[0]) else None
        return dot_class.faster(_bind(lib), _bind(rival)) if rival is not None else _bind(lib)
    lib = _open(want)
    if lib is None:
        have = ", ".join(supported_isas() + [TORCH] + emulated_isas())
        raise IsaError(f"{ENV_ISA}={want}: this CPU (or the C++ compiler) cannot run it; available: {have}")
    return _bind(lib)


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _choose()
                _tried = True
    return _lib


def library() -> ctypes.CDLL | None:
    """The chosen class's library, bound, or None where there is none: for the modules that
    wrap more of its entry points (`native_rows`)."""
    return _library()


def isa() -> str:
    """The ISA class the native kernels run with, or "torch" where there are none."""
    lib = _library()
    return lib.isa if lib is not None else TORCH


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the block with ISA class `name` (or "torch"), as LLAMA_NPU_ISA would; for tests and
    A/B measurements in one process. Calls bound before the switch keep the library they bound."""
    global _lib, _tried, _forced
    if name not in (*ALL_CLASSES, TORCH):
        raise IsaError(f"unknown ISA class {name!r}")
    with _lock:
        saved = _lib, _tried, _forced
        _lib, _tried, _forced = None, False, name
    try:
        _library()
        yield
    finally:
        with _lock:
            _lib, _tried, _forced = saved


def stream_ahead() -> int:
    """How far ahead the decode GEMVs prefetch their weights, in bytes; 0 without the native library."""
    lib = _library()
    return lib.stream_ahead_bytes() if lib is not None else 0


@contextlib.contextmanager
def pinned_stream_ahead(nbytes: int) -> Iterator[None]:
    """The decode GEMVs prefetch `nbytes` ahead inside the block (A/B measurements, tests), then
    as LLAMA_NPU_STREAM_AHEAD says."""
    lib = _library()
    if lib is not None:
        lib.stream_ahead_set(nbytes)
    try:
        yield
    finally:
        if lib is not None:
            lib.stream_ahead_set(ahead_from_env())


# The decode GEMVs' prefetch hints by name, as __builtin_prefetch's locality (stream_ahead_cpu.cc).
STREAM_HINTS = {"nta": 0, "t1": 2, "t0": 3}


def stream_hint() -> str:
    """The decode GEMVs' prefetch hint, a key of STREAM_HINTS (stream_ahead_cpu.cc chooses it by
    the CPU's maker); "" without the native library."""
    lib = _library()
    if lib is None:
        return ""
    return next(name for name, level in STREAM_HINTS.items() if level == lib.stream_hint_locality())


@contextlib.contextmanager
def pinned_stream_hint(hint: str) -> Iterator[None]:
    """The decode GEMVs prefetch with `hint` (a key of STREAM_HINTS) inside the block (A/B
    measurements, tests), then with the CPU's default."""
    if hint not in STREAM_HINTS:
        raise ValueError(f"prefetch hint {hint!r}: expected one of {', '.join(STREAM_HINTS)}")
    lib = _library()
    if lib is not None:
        lib.stream_hint_set(STREAM_HINTS[hint])
    try:
        yield
    finally:
        if lib is not None:
            lib.stream_hint_set(-1)


def available() -> bool:
    return _library() is not None


def tile_rows() -> int:
    """Outputs per tile block in the layout the native GEMM and GEMV read (0 if unavailable)."""
    lib = _library()
    return lib.tile_rows if lib is not None else 0


def tile_dot(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """One AMX tile step, c [16, 16] f32 += a [16, 32] bf16 · b [16, 32] bf16 (row p: K-pair p of 16
    outputs, interleaved), in place; False where the class has no tiles. For the tests that hold
    the tile step, real or emulated, to the SDM bit for bit."""
    lib = _library()
    if (lib is None or a.shape != (16, 32) or b.shape != (16, 32) or c.shape != (16, 16) or c.dtype != torch.float32
            or not all(t.is_contiguous() for t in (a, b, c)) or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16):
        return False
    return bool(lib.tiles_dot_bf16_cpu(a.data_ptr(), b.data_ptr(), c.data_ptr()))


def packed_header() -> int:
    """Bytes of a packed weight's header in the layout the native kernels read (0 if unavailable)."""
    lib = _library()
    return lib.packed_header if lib is not None else 0


def usable(*ts: torch.Tensor) -> ctypes.CDLL | None:
    """The library, where there is one and every tensor is contiguous bf16 (what the kernels
    on bf16 operands take); else None, and the caller takes its torch path."""
    lib = _library()
    if lib is None or not all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in ts):
        return None
    return lib


def tileable(n: int, k: int) -> bool:
    """Whether an [n, k] weight fits the packed tiles the native GEMM and GEMV read: whole
    blocks of rows and whole units of two K-pairs."""
    lib = _library()
    return lib is not None and n % lib.tile_rows == 0 and k % 4 == 0


def _packed(w: torch.Tensor, n: int, k: int) -> bool:
    """w is a packed [n, k] weight (its header says so)."""
    if not (w.dtype == torch.uint8 and w.is_contiguous() and tileable(n, k)):
        return False
    header = _library().packed_header
    return w.numel() >= header and w[:header].view(torch.int64)[2:4].tolist() == [n, k]


def pack_weight(w: torch.Tensor, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
    """The row-major [N, K] bf16 weight w in packed tiles (`weight_tiles`), in a uint8 buffer
    from `alloc(nbytes)`; None if unavailable or the shape does not fit."""
    lib = usable(w)
    if lib is None or w.dim() != 2 or not tileable(*w.shape):
        return None
    pairs = ctypes.c_int64()
    out = alloc(lib.pack_weight_bf16_cpu_plan(w.data_ptr(), *w.shape, ctypes.byref(pairs)))
    lib.pack_weight_bf16_cpu(w.data_ptr(), *w.shape, pairs.value, out.data_ptr())
    return out


def gemv_batch_call(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Callable[[], None] | None:
    """y = W x for each (packed W, x, y) in one native dispatch, bound to these tensors; None if
    the native path is unavailable. W holds y.numel() × x.numel() weights.

    The `*_call` forms fix pointers and sizes once, so the simulated device can replay a launch
    program without re-deriving them on every call."""
    return _batch_call("gemv_packed_bf16_cpu_batch", _packed, jobs)


def _q4nx_bytes(w: torch.Tensor, n: int, k: int) -> bool:
    """w holds a Q4NX [n, k] matrix (`llama_base.q4nx`) the native kernels can take."""
    return (w.dtype == torch.uint8 and w.is_contiguous() and q4nx.fits(n, k)
            and w.numel() == q4nx.nbytes(n, k))


def gemv_q4nx_batch_call(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Callable[[], None] | None:
    """y = W x for each (Q4NX W bytes, x, y) in one native dispatch, bound; None if unavailable.
    The sums are `q4nx.gemv_reference`'s at the class's activation width
    (`q4nx_activation_bytes`), bit for bit per group (exact integers); the groups combine in f32
    in the kernel's order."""
    return _batch_call("gemv_q4nx_cpu_batch", _q4nx_bytes, jobs)


def q4nx_activation_bytes(isa: str) -> int:
    """Decode's Q4NX activation width on class `isa` (`q4nx.WIDE` or `q4nx.NARROW`; the torch
    bodies take `q4nx.WIDE`): the `act_bytes` its GEMV, and its integer prefill, meet
    `q4nx.gemv_reference` at."""
    return activation_bytes(isa)


def integer_q4nx_gemm(isa: str) -> bool:
    """Whether class `isa`'s prefill runs Q4NX on decode's integer contract (each output row is
    the GEMV's for that activation row, `q4nx.gemv_reference`'s numbers) rather than on weights
    dequantized to bf16 (`q4nx.dequantize`, then the bf16 GEMM): the two differ in the last bits."""
    return isa in INTEGER_Q4NX_GEMM


def gemm_q4nx_call(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                   integer: bool | None = None) -> Callable[[], None] | None:
    """out[M, N] = a[M, K] · Wᵀ with W [N, K] in Q4NX bytes, bound; None if unavailable.

    The class decides how (`integer_q4nx_gemm`): row by row the GEMV's fixed-point product, or
    W dequantized to bf16 as it streams. `integer` forces one, for tests and A/B measurements;
    the integer kernel exists in every class, register-blocked only in the AVX2 build."""
    lib = _library()
    if integer is None:
        integer = lib is not None and integer_q4nx_gemm(lib.isa)
    return _gemm_call("gemm_q4nx_int_cpu" if integer else "gemm_q4nx_cpu", _q4nx_bytes, a, w, out)


class NativeCall(partial):
    """A function of the native library bound to its arguments (`_bound`): what a native
    program replays (`NativeProgram.bound`), where a torch body bound the same way is not."""


def _bound(fn: Callable, tensors, *args) -> NativeCall:
    """`fn` bound to `args`, raw addresses among them, holding the tensors they point into: a
    bound call outlives the statement that made it (the simulated device replays it on every
    run), and memory freed under it would be written to by the next run."""
    call = NativeCall(fn, *args)
    call.tensors = tuple(tensors)
    return call


class CheckedCall(NativeCall):
    """A bound native call whose kernel may refuse what it reads when it runs (a position outside
    the cache, read through a pointer the call holds): it then reads and writes nothing and sets
    its status word, which each call checks, raising `refused()`. A native program replaying the
    call checks after its run (`NativeProgram.bound`)."""

    def __call__(self, *args, **kwargs) -> None:
        super().__call__(*args, **kwargs)
        self.check()

    def check(self) -> None:
        """Raise `refused()` if the last run refused its operands."""
        if self.status[0]:
            raise self.refused()


def _checked(fn: Callable, tensors, refused: Callable[[], Exception], *args) -> CheckedCall:
    """`fn` bound to `args` and a status word of its own (its last argument), as `_bound`."""
    status = (ctypes.c_int32 * 1)()
    call = CheckedCall(fn, *args, status)
    call.tensors, call.status, call.refused = tuple(tensors), status, refused
    return call


def _batch_call(symbol: str, holds: Callable, jobs) -> Callable[[], None] | None:
    """One native dispatch of GEMVs (W, x, y), each 5 int64 slots (w, x, y, rows, k), bound, when
    every W `holds` its [y, x] matrix in the kernel's format."""
    lib = usable(*(t for _, x, y in jobs for t in (x, y)))
    if lib is None or not all(holds(w, y.numel(), x.numel()) for w, x, y in jobs):
        return None
    desc = (ctypes.c_int64 * (5 * len(jobs)))()
    for i, (w, x, y) in enumerate(jobs):
        desc[5 * i:5 * i + 5] = [w.data_ptr(), x.data_ptr(), y.data_ptr(), y.numel(), x.numel()]
    return _bound(getattr(lib, symbol), [t for job in jobs for t in job], desc, len(jobs))


def _gemm_call(symbol: str, holds: Callable, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor):
    lib = usable(a, out)
    if lib is None or a.dim() != 2 or out.dim() != 2 or a.shape[0] != out.shape[0]:
        return None
    (m, k), n = a.shape, out.shape[1]
    if not holds(w, n, k):
        return None
    return _bound(getattr(lib, symbol), (a, w, out), a.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k)


def gemm_call(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Callable[[], None] | None:
    """out[M, N] = a[M, K] · Wᵀ with W [N, K] packed, bound; None if the native path is unavailable."""
    return _gemm_call("gemm_packed_bf16_cpu", _packed, a, w, out)


def rmsnorm_call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, dim: int, eps: float) -> Callable[[], None] | None:
    """out = x / rms(x) · w over rows of `dim`, bound; None if the native path is unavailable."""
    lib = usable(x, w, out)
    if lib is None:
        return None
    return _bound(lib.rmsnorm_bf16_cpu, (x, w, out), x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // dim,
                  dim, eps)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, dim: int, eps: float) -> bool:
    call = rmsnorm_call(x, w, out, dim, eps)
    if call is not None:
        call()
    return call is not None


def _binary(symbol: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Callable[[], None] | None:
    lib = usable(a, b, out)
    if lib is None:
        return None
    return _bound(getattr(lib, symbol), (a, b, out), a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel())


def swiglu_call(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> Callable[[], None] | None:
    """out = silu(gate) · up, bound; None if the native path is unavailable."""
    return _binary("swiglu_bf16_cpu", gate, up, out)


def add_call(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Callable[[], None] | None:
    """out = a + b (exact in f32, rounded once), bound; None if the native path is unavailable."""
    return _binary("add_bf16_cpu", a, b, out)


def rope_call(x: torch.Tensor, lut: torch.Tensor, out: torch.Tensor, rows: int, heads: int,
              head_dim: int) -> Callable[[], None] | None:
    """Half-split rotation of [rows, heads, head_dim] by each row's cos | sin, bound; None if unavailable."""
    lib = usable(x, lut, out)
    if lib is None or head_dim % 2:
        return None
    return _bound(lib.rope_bf16_cpu, (x, lut, out), x.data_ptr(), lut.data_ptr(), out.data_ptr(), rows, heads, head_dim)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, out: torch.Tensor) -> bool:
    """One query's GQA attention over positions 0..n-1 of one layer's head-major cache.

    q, out: [heads·d] bf16; k, v: [kv_heads, max_seq, d] bf16. False if the native path is unavailable.
    """
    lib = usable(q, k, v, out)
    kvh, stride, d = k.shape
    if lib is None or d > lib.max_head_dim or not 0 < n <= stride:
        return False
    lib.attention_bf16_cpu(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.numel() // d, kvh, d, n, stride)
    return True


def decode_step_calls(q: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor) -> tuple[Callable, Callable] | None:
    """The native KV row store and single-query attention (`kv_store_row`, `decode_attention`)
    for a decode step that calls them by address on these tensors every token, after this one
    check of them; None if the native path cannot take them."""
    lib = usable(q, k_row, v_row, k, v, out)
    if lib is None or k.dim() != 4 or v.shape != k.shape:
        return None
    _, kvh, _, d = k.shape
    if d > lib.max_head_dim or k_row.numel() != kvh * d or v_row.numel() != kvh * d \
            or q.numel() % d or q.numel() != out.numel() or (q.numel() // d) % kvh:
        return None
    return lib.kv_store_row_bf16_cpu, lib.attention_bf16_cpu


def kv_store_row(k_row: torch.Tensor, v_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 pos: int) -> bool:
    """One token's K/V rows [kv_heads·d] into the [layers, kv_heads, max_seq, d] caches at `pos`,
    by pointer arithmetic: a decode step stores a row per layer, and indexing the caches for it
    costs more than the 2 KiB it moves. False if the native path is unavailable."""
    lib = usable(k_row, v_row, k, v)
    layers, kvh, stride, d = k.shape
    if (lib is None or v.shape != k.shape or not 0 <= layer < layers or not 0 <= pos < stride
            or k_row.numel() != kvh * d or v_row.numel() != kvh * d):
        return False          # the torch path then raises for what is out of range
    at = ((layer * kvh) * stride + pos) * d * k.element_size()
    lib.kv_store_row_bf16_cpu(k_row.data_ptr(), v_row.data_ptr(), k.data_ptr() + at, v.data_ptr() + at, kvh, d, stride)
    return True


_FLASH_DIM_STEP = 64    # the kernel's P·V tile covers 64 head dims


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, out: torch.Tensor) -> bool:
    """Causal GQA attention of a chunk: query i (position start + i) over cache rows 0..start + i.

    q, out: [s, heads, d] bf16; k, v: [kv_heads, c, d] bf16, rows of each head contiguous (the
    heads may be strided, as in a slice of the cache). False if the native path is unavailable.
    """
    s, heads, d = q.shape
    kvh, c, _ = k.shape
    lib = usable(q, out)
    if (lib is None or d % _FLASH_DIM_STEP or d > lib.flash_max_head_dim or heads % kvh or k.stride() != v.stride()
            or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.stride()[1:] != (d, 1)):
        return False
    lib.flash_attention_bf16_cpu(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), s, c, heads, kvh, d,
                                 start, k.stride(0) // d)
    return True


def _position_word(t: torch.Tensor) -> bool:
    """t is an i32 whose first element a kernel can read through its address."""
    return t.dtype == torch.int32 and t.numel() >= 1 and t.is_contiguous()


def _f32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def _refused() -> Exception:
    return IndexError("a position outside the cache")



def attention_at_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                      refused: Callable[[], Exception] = _refused) -> CheckedCall | None:
    """`decode_attention` bound, over positions 0..pos[0] of a resident cache [kv_heads,
    capacity, d]: the kernel reads the position through pos's address when it runs, as the
    NPU's cores read theirs, so one bound call serves every token; one outside the cache reads
    and writes nothing and raises `refused()`. None if unavailable."""
    lib = usable(q, k, v, out)
    if lib is None or k.dim() != 3 or not _position_word(pos):
        return None
    kvh, stride, d = k.shape
    if d > lib.max_head_dim or v.shape != k.shape or q.numel() % d or (q.numel() // d) % kvh \
            or out.numel() != q.numel():
        return None
    shape = (ctypes.c_int64 * 4)(q.numel() // d, kvh, d, stride)
    return _checked(lib.attention_at_bf16_cpu, (q, k, v, pos, out), refused, q.data_ptr(), k.data_ptr(),
                    v.data_ptr(), out.data_ptr(), pos.data_ptr(), shape)


def kv_append_call(k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: int,
                   refused: Callable[[], Exception] = _refused) -> CheckedCall | None:
    """`rows` token-major K/V rows [rows, kv_heads, d] into the head-major caches [kv_heads,
    capacity, d] at positions start[0].., bound; None if the native path cannot take them.

    The position is read when the call runs, through start's address: bound once, the call
    follows every new value written there. One whose rows do not fit writes nothing and raises
    `refused()` (`CheckedCall`)."""
    lib = usable(k, v, k_cache, v_cache)
    if lib is None or k_cache.dim() != 3 or v_cache.shape != k_cache.shape or not _position_word(start) or rows < 1:
        return None
    kvh, cap, d = k_cache.shape
    if k.numel() != rows * kvh * d or v.numel() != rows * kvh * d:
        return None
    shape = (ctypes.c_int64 * 4)(rows, kvh, d, cap)
    return _checked(lib.kv_append_bf16_cpu, (k, v, start, k_cache, v_cache), refused, k.data_ptr(), v.data_ptr(),
                    start.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), shape)


def decode_attn_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     acc: torch.Tensor, stats: torch.Tensor, chunk: int, splits: int,
                     refused: Callable[[], Exception] = _refused) -> CheckedCall | None:
    """One token's split-K attention over positions 0..pos[0] of one layer's resident cache
    (`ops.decode_attn`'s contract), bound; None if the native path cannot take the operands.

    q: [kv_heads · group · d] bf16; k_cache, v_cache: [kv_heads, capacity, d] bf16; acc:
    [kv_heads, splits, group, d] f32 and stats [kv_heads, splits, group, 2] f32, each split's
    unnormalised sums and its (max, total). The position is read when the call runs, through
    pos's address; one outside the cache reads and writes nothing and raises `refused()`. The
    (KV head, split) items are shared by the OpenMP team; the bits do not depend on its size."""
    lib = usable(q, k_cache, v_cache)
    if (lib is None or k_cache.dim() != 3 or v_cache.shape != k_cache.shape or not _position_word(pos)
            or not _f32(acc, stats) or chunk < 1 or splits < 1):
        return None
    kvh, cap, d = k_cache.shape
    if d > lib.resident_max_head_dim or q.numel() % (kvh * d):
        return None
    group = q.numel() // (kvh * d)
    if group < 1 or acc.numel() != kvh * splits * group * d or stats.numel() != kvh * splits * group * 2:
        return None
    shape = (ctypes.c_int64 * 6)(kvh, group, d, cap, chunk, splits)
    return _checked(lib.decode_attn_bf16_cpu, (q, k_cache, v_cache, pos, acc, stats), refused, q.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), pos.data_ptr(), acc.data_ptr(), stats.data_ptr(), shape)


def attn_merge_call(acc: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, kv_heads: int, splits: int,
                    d: int) -> Callable[[], None] | None:
    """`decode_attn_call`'s splits combined into each query head's row of out [q_heads · d]
    bf16 (`ops.attn_merge`'s contract), bound; None if the native path cannot take them."""
    lib = usable(out)
    if lib is None or not _f32(acc, stats) or min(kv_heads, splits, d) < 1 or d > lib.resident_max_head_dim \
            or out.numel() % (kv_heads * d):
        return None
    group = out.numel() // (kv_heads * d)
    if group < 1 or acc.numel() != kv_heads * splits * group * d or stats.numel() != kv_heads * splits * group * 2:
        return None
    return _bound(lib.attn_merge_bf16_cpu, (acc, stats, out), acc.data_ptr(), stats.data_ptr(), out.data_ptr(),
                  kv_heads, splits, group, d)
