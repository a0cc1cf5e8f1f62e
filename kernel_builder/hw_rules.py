"""What the NPU2 (AIE2P) hardware accepts of a module's data movement and memory, declared once.

The validator applies these rules to a module without running it (`multi_launch_builder.hw_check`:
sizes and strides must be constants, offsets are bounded by a known divisor of every value
they take), and the interpreter applies the same functions to every DMA it executes, with the
values of that iteration. Each rule is a fact about the hardware or its lowering; where it
comes from (read for the fact only):

- DMAs move 32-bit words: mlir-aie `lib/Dialect/AIEX/IR/AIEXDialect.cpp`
  (`NpuDmaMemcpyNdOp::verify`: "Minimum data transfer size required is 32bits", "Offset must
  be 4-byte-aligned"; `verifyStridesWraps`: transfer sizes and every stride but a unit
  innermost one must be whole 4-byte granules; `getAddressGenGranularity` is 32 bits on AIE2).
- Per-dimension limits, per tile kind (`verifyStridesWraps`, same file): sizes of d0 (in
  words) and d1 fit a wrap field of 10 bits on shim and memory tiles and 8 bits on compute
  tiles; strides (in words) at most 2^20 (shim), 2^17 (memory tile), 2^13 (compute tile); the
  shim's fourth dimension is an iteration count of at most 2^6. A contiguous transfer is
  lowered in linear mode, whose length field is 32 bits (shim), 17 bits (memory tile) or
  14 bits (compute tile) of words (the comment on `LinearizeContiguousTransfer`, same file).
- Dimensions a buffer descriptor walks: 3 on a compute tile, 4 on a memory tile, 3 plus the
  iteration on a shim tile (AMD AM020, AIE-ML architecture manual: tile, memory-tile and
  interface-tile DMA chapters).
- Buffer descriptors per tile: 16 on compute and shim tiles, 48 on a memory tile (mlir-aie
  `include/aie/Dialect/AIE/IR/AIETargetModel.h`, `AIE2TargetModel::getNumBDs`). DMA channels:
  2 S2MM + 2 MM2S on compute and shim tiles, 6 + 6 on a memory tile (AM020); mlir-air assigns
  several memcpys to one channel (`lib/Conversion/AIRToAIESchedulingUtils.cpp`,
  `DMAAllocator::allocNewDmaChannel` appends an op to an allocated channel), so the number of
  DMA ops is not bounded by the channels; it is bounded by the descriptors they need.
- Locks: 16 per compute and shim tile, 64 per memory tile (mlir-aie `AIETargetModel.h`,
  `AIE2TargetModel::getNumLocks`). AIE2 locks are semaphores, and mlir-air's lowering gives
  every buffer a DMA fills or drains a pair of them, one counting the free slots and one the
  full ones (`lib/Conversion/AIRToAIESchedulingUtils.cpp`, `DMAAllocator::getLockForDMA`:
  `rlock` and `wlock`). Later descriptors of the same buffer on the same channel reuse the
  pair, and so, on a memory tile, does the buffer's other direction. A compute tile's buffer
  filled and drained on its two channel directions has a pair for each. A ping-ponged
  buffer's two halves share one pair (mlir-air test
  `Conversion/AIRToAIE/async_gemm_w_pingpong_to_locks_npu.mlir`: cores holding A and B
  ping-ponged and C single, five buffers, have six locks).
- Memory: 64 KiB of data memory per compute tile (`getLocalMemorySize`), 512 KiB per memory
  tile (`getMemTileSize`); `L1_BUDGET` keeps 8 KiB of a core's data memory for its stack
  (mlir-air's default core stack is 1 KiB, `AIRToAIEPass.cpp`; the rest is slack for what the
  compiler adds). A segment's L2 is held to one memory tile in total. That is stricter than
  mlir-air's lowering, which gives a segment a memory tile per column it spans and places each
  L2 buffer whole on one of them (`AIRToAIEPass.cpp`: `outlineAIEMemtiles`,
  `L2MemrefToMemTileMap`); the rule stays this strict until a toolchain run shows a segment
  spread over several memory tiles compile (docs/profile.md, "Q4NX on the NPU", says what
  it would allow).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# NPU2 (Strix, AIE2P): 8 columns x 4 compute rows, a memory tile per column.
ARRAY_COLS, ARRAY_ROWS = 8, 4
L1_BYTES = 64 * 1024             # data memory of a compute tile
L1_BUDGET = L1_BYTES - 8 * 1024  # what buffers may use: the rest is the core's stack and slack
L2_BYTES = 512 * 1024            # one memory tile: an L2 buffer never spans two
ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "i8": 1}   # bytes of an MLIR element type
WORD = 4            # bytes: the DMAs' address granularity
L1, L2, L3 = 2, 1, 0
DOUBLE_BUFFER = 2   # a buffer a DMA fills or drains inside a loop is ping-ponged by the compiler


@dataclass(frozen=True)
class DmaEngine:
    """One tile kind's DMA, as its buffer descriptors constrain an access pattern."""

    tile: str
    dims: int               # dimensions one descriptor walks (the shim's last is its iteration)
    wrap_bits: int          # d0 (in words) and d1 sizes
    stride_bits: int        # a stride, in words, is at most 2**stride_bits
    linear_bits: int        # length, in words, of a contiguous transfer
    iteration_bits: int     # the outermost dimension's count, when it is an iteration (0: none)
    bds: int
    channels: int           # per direction
    locks: int              # per tile

    @property
    def max_wrap(self) -> int:
        return (1 << self.wrap_bits) - 1


CORE = DmaEngine("compute tile", 3, 8, 13, 14, 0, 16, 2, 16)
MEMTILE = DmaEngine("memory tile", 4, 10, 17, 17, 0, 48, 6, 64)
SHIM = DmaEngine("shim tile", 4, 10, 20, 32, 6, 16, 2, 16)
LOCKS_PER_BUFFER = 2     # semaphore locks the lowering pairs with a buffer a DMA moves
ENGINE = {L1: CORE, L2: MEMTILE, L3: SHIM}     # which tile's DMA serves a side in this memory space


def canonical(sizes: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """(size, stride) per dimension, innermost first, as a descriptor walks them: unit sizes
    dropped, and a pattern that is one contiguous run made that one run (the DMA moves it in
    linear mode). Other dimensions stay as written: splitting a run is how a pattern fits a wrap."""
    dims = [(size, stride) for size, stride in reversed(list(zip(sizes, strides))) if size != 1]
    run = 1
    for size, stride in dims:
        if stride != run:
            return dims
        run *= size
    return [(run, 1)]


def dma_side_problems(space: int, itemsize: int, offset_bytes: int, sizes: Sequence[int | None],
                      strides: Sequence[int | None], nbytes: int, offset_exact: bool = True) -> list[str]:
    """What one side of a DMA (a buffer in `space`, `itemsize`-byte elements) breaks.

    `offset_bytes` is the first byte's offset, or (`offset_exact` False) a known divisor of
    every value it takes (a check that it is a multiple of 4 holds the same); sizes and strides are exact, None when
    not known. Empty `sizes` means the whole `nbytes` buffer."""
    eng = ENGINE[space]
    out: list[str] = []
    if not sizes:
        if nbytes % WORD:
            out.append(f"moves a whole buffer of {nbytes} bytes, not whole 32-bit words")
        elif nbytes // WORD > (1 << eng.linear_bits) - 1:
            out.append(f"moves {nbytes // WORD} words in one transfer; a {eng.tile} DMA moves at most "
                       f"{(1 << eng.linear_bits) - 1}")
        return out
    if any(v is None for v in (*sizes, *strides)):
        return [f"sizes {list(sizes)} / strides {list(strides)} are not compile-time constants"]
    if offset_bytes % WORD:
        at = f"byte offset {offset_bytes}" if offset_exact else f"byte offsets known only to be multiples of {offset_bytes}"
        out.append(f"starts at {at}, not on a 32-bit word")
    dims = canonical(sizes, strides)       # type: ignore[arg-type]
    inner, step = dims[0]
    run = inner * itemsize if step == 1 else itemsize
    if run % WORD:
        out.append(f"moves contiguous runs of {run} bytes, not whole 32-bit words")
    outer = dims[1:] if step == 1 else dims
    for size, stride in outer:
        if stride * itemsize % WORD:
            out.append(f"steps {stride * itemsize} bytes between runs, not whole 32-bit words")
    if out:
        return out
    if len(dims) == 1 and step == 1:
        if run // WORD > (1 << eng.linear_bits) - 1:
            out.append(f"moves {run // WORD} words in one transfer; a {eng.tile} DMA moves at most "
                       f"{(1 << eng.linear_bits) - 1}")
        return out
    if len(dims) > eng.dims:
        out.append(f"walks {len(dims)} dimensions {_show(dims)}; a {eng.tile} DMA walks at most {eng.dims}")
        return out
    wraps = [run // WORD if step == 1 else inner] + [s for s, _ in dims[1:2]]
    for d, w in enumerate(wraps):
        if w > eng.max_wrap:
            out.append(f"dimension {d} of {_show(dims)} has size {w}{' words' if d == 0 and step == 1 else ''}; "
                       f"a {eng.tile} DMA wraps at most {eng.max_wrap}")
    for d, (_, stride) in enumerate(dims):
        words = stride * itemsize // WORD
        if (d > 0 or step != 1) and words > 1 << eng.stride_bits:
            out.append(f"dimension {d} of {_show(dims)} steps {words} words; a {eng.tile} DMA steps at most "
                       f"{1 << eng.stride_bits}")
    if eng.iteration_bits and len(dims) == eng.dims and dims[-1][0] > 1 << eng.iteration_bits:
        out.append(f"repeats {dims[-1][0]} times; a {eng.tile} DMA iterates at most {1 << eng.iteration_bits}")
    return out


def split_long_run(space: int, itemsize: int, n: int) -> int | None:
    """For a strided pattern whose contiguous innermost run of `n` elements is longer than the
    wrap of the DMA serving `space`: the longest whole-word piece, dividing `n`, that fits it
    (the run is then walked as n / piece runs of `piece`, one more dimension); None when the run
    fits or no piece does."""
    limit = ENGINE[space].max_wrap * WORD
    if n * itemsize <= limit:
        return None
    for piece in range(limit // itemsize, 0, -1):
        if n % piece == 0 and piece * itemsize % WORD == 0:
            return piece
    return None


def _show(dims: list[tuple[int, int]]) -> str:
    """Outermost first, as the op spells sizes and strides."""
    return f"sizes {[s for s, _ in reversed(dims)]} strides {[t for _, t in reversed(dims)]}"


def l1_problem(nbytes: int) -> str | None:
    if nbytes > L1_BUDGET:
        return (f"core holds {nbytes} bytes of L1 (double buffers counted twice), over the {L1_BUDGET}-byte "
                f"budget ({L1_BYTES} bytes of data memory less the stack)")
    return None


def l2_problem(nbytes: int) -> str | None:
    if nbytes > L2_BYTES:
        return f"segment holds {nbytes} bytes of L2 (double buffers counted twice), over one {L2_BYTES}-byte memory tile"
    return None


def herd_problem(sizes: Sequence[int]) -> str | None:
    if len(sizes) != 2 or sizes[0] > ARRAY_COLS or sizes[1] > ARRAY_ROWS or min(sizes) < 1:
        return f"herd of {list(sizes)} does not fit the {ARRAY_COLS}x{ARRAY_ROWS} NPU2 array"
    return None


def bd_problem(n: int, engine: DmaEngine, where: str) -> str | None:
    if n > engine.bds:
        return (f"{where} needs at least {n} buffer descriptors (one per DMA op); "
                f"a {engine.tile} has {engine.bds}")
    return None


def lock_problem(buffers: int, engine: DmaEngine, where: str) -> str | None:
    """`buffers`: what a tile's DMAs move, each needing its own pair of locks (on a compute
    tile a buffer per direction it moves in, on a memory tile a buffer)."""
    n = LOCKS_PER_BUFFER * buffers
    if n > engine.locks:
        return (f"{where} needs at least {n} locks (a pair for each of {buffers} buffers its DMAs move); "
                f"a {engine.tile} has {engine.locks}")
    return None


def gcd_all(values: Sequence[int]) -> int:
    return math.gcd(*values) if values else 0
