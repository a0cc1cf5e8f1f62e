"""Q4NX, the 4-bit weight format: its byte layout, declared once, and its bit-exact codec.

Q4NX is per-group 4-bit affine quantization along the input dimension, the format of the Ryzen
AI NPU papers this design follows: every run of `GROUP` consecutive weights of one output row
shares a bf16 `scale` and a bf16 `min`, and weight `w = q * scale + min` for a 4-bit `q`. bf16,
because the NPU's vector unit multiplies bf16; a per-group min (not a symmetric zero point)
because the weights of a group are rarely centred on zero.

A weight matrix W [N, K] (output rows, input columns; N a multiple of `ROWS`, K of `GROUP`) is
stored as blocks of `ROWS` x `COLS` weights: row-block by row-block, and within a row-block
column-block by column-block, the last one narrower when K is not a multiple of `COLS` (its
width is still a multiple of `GROUP`). A block of width c holds, in this order:

- the 4-bit values, column-major: column j of the block is `ROWS // 2` bytes, byte i holding
  row i in its low nibble and row i + ROWS/2 in its high nibble;
- the scales, bf16 [c / GROUP][ROWS] (group-major, so one group's scales for the block's rows
  are one vector);
- the mins, bf16 [c / GROUP][ROWS].

That is 20 bytes per column of a block, 5120 for a whole 32 x 256 block: 5 bits per weight.
A row-block is one contiguous run of 20 K bytes, so a core that owns a slab of output rows
reads it with one DMA; within it a block's values arrive before the scales that finish its
sums. The half-split nibble order lets a 16-lane vector take the low nibbles of a column's
bytes as rows 0-15 and the high ones as rows 16-31 with one mask and one shift.

Everything that reads or writes Q4NX bytes (the quantizer, the kernel-group declarations and
MLIR builders, the NPU kernels, the simulated device's CPU kernels, the interpreter) takes its
numbers from here; `unpack` below is the reference decoder the tests hold every kernel to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 32            # output rows per block
COLS = 256           # input columns per (full) block
GROUP = 32           # input columns sharing one scale and one min
LEVELS = 15          # largest 4-bit value
NIBBLE_BYTES_PER_COL = ROWS // 2
BYTES_PER_COL = NIBBLE_BYTES_PER_COL + 2 * 2 * ROWS // GROUP   # nibbles + a bf16 scale and min per row, per GROUP columns
NAME = "q4nx"


class Q4nxShapeError(ValueError):
    """A matrix shape the format cannot hold."""


@dataclass(frozen=True)
class Layout:
    """Where everything of one Q4NX matrix [n, k] lives in its byte buffer."""

    n: int
    k: int

    def __post_init__(self):
        wrong = [f"{count} {what}" for count, what, unit in ((self.n, "rows", ROWS), (self.k, "columns", GROUP))
                 if count <= 0 or count % unit]
        if wrong:
            raise Q4nxShapeError(f"a Q4NX matrix needs rows in multiples of {ROWS} and columns in multiples "
                                 f"of {GROUP}; [{self.n}, {self.k}] has {' and '.join(wrong)}")

    @property
    def nbytes(self) -> int:
        return self.n * self.k * BYTES_PER_COL // ROWS

    @property
    def row_block_bytes(self) -> int:
        return self.k * BYTES_PER_COL

    @property
    def row_blocks(self) -> int:
        return self.n // ROWS

    def col_blocks(self) -> list[tuple[int, int]]:
        """(first column, width) of each block of a row-block."""
        return [(c, min(COLS, self.k - c)) for c in range(0, self.k, COLS)]

    def block_offset(self, row_block: int, col0: int) -> int:
        """Byte offset of the block of `row_block` that starts at column `col0`."""
        return row_block * self.row_block_bytes + col0 * BYTES_PER_COL


def nbytes(n: int, k: int) -> int:
    return Layout(n, k).nbytes


def fits(n: int, k: int) -> bool:
    return n > 0 and k > 0 and n % ROWS == 0 and k % GROUP == 0


def _blocks(layout: Layout):
    """(col0, width, quant slice, scale slice, min slice) of every block within a row-block."""
    for c0, c in layout.col_blocks():
        at = c0 * BYTES_PER_COL
        q_end = at + c * NIBBLE_BYTES_PER_COL
        s_end = q_end + c // GROUP * ROWS * 2
        yield c0, c, slice(at, q_end), slice(q_end, s_end), slice(s_end, s_end + c // GROUP * ROWS * 2)


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The Q4NX bytes (uint8 [nbytes]) of values q (integers 0..15, [n, k]) with bf16 scales and
    mins ([n, k / GROUP])."""
    n, k = q.shape
    layout = Layout(n, k)
    if scale.shape != (n, k // GROUP) or minimum.shape != (n, k // GROUP):
        raise Q4nxShapeError(f"scales {tuple(scale.shape)} / mins {tuple(minimum.shape)} do not match [{n}, {k}]")
    q8 = q.to(torch.uint8).view(layout.row_blocks, ROWS, k)
    out = torch.empty(layout.row_blocks, layout.row_block_bytes, dtype=torch.uint8)
    half = ROWS // 2
    sc = scale.to(torch.bfloat16).view(layout.row_blocks, ROWS, k // GROUP)
    mn = minimum.to(torch.bfloat16).view(layout.row_blocks, ROWS, k // GROUP)
    for c0, c, qs, ss, ms in _blocks(layout):
        cols = q8[:, :, c0:c0 + c]                                   # [rb, ROWS, c]
        nib = (cols[:, :half] | (cols[:, half:] << 4)).transpose(1, 2)   # [rb, c, ROWS/2]
        out[:, qs] = nib.reshape(layout.row_blocks, -1)
        g0, g1 = c0 // GROUP, (c0 + c) // GROUP
        out[:, ss] = sc[:, :, g0:g1].transpose(1, 2).contiguous().view(torch.uint8).reshape(layout.row_blocks, -1)
        out[:, ms] = mn[:, :, g0:g1].transpose(1, 2).contiguous().view(torch.uint8).reshape(layout.row_blocks, -1)
    return out.view(-1)


def unpack(buf: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [n, k], scale bf16 [n, k / GROUP], min bf16 [n, k / GROUP]) from Q4NX bytes."""
    layout = Layout(n, k)
    if buf.dtype != torch.uint8 or buf.numel() != layout.nbytes:
        raise Q4nxShapeError(f"a Q4NX [{n}, {k}] matrix is {layout.nbytes} bytes of uint8, "
                             f"got {buf.numel()} {buf.dtype}")
    rb, half = layout.row_blocks, ROWS // 2
    b = buf.reshape(rb, layout.row_block_bytes)
    q = torch.empty(rb, ROWS, k, dtype=torch.uint8)
    sc = torch.empty(rb, ROWS, k // GROUP, dtype=torch.bfloat16)
    mn = torch.empty(rb, ROWS, k // GROUP, dtype=torch.bfloat16)
    for c0, c, qs, ss, ms in _blocks(layout):
        nib = b[:, qs].reshape(rb, c, half).transpose(1, 2)          # [rb, ROWS/2, c]
        q[:, :half, c0:c0 + c] = nib & 15
        q[:, half:, c0:c0 + c] = nib >> 4
        g0, g1 = c0 // GROUP, (c0 + c) // GROUP
        sc[:, :, g0:g1] = b[:, ss].contiguous().view(torch.bfloat16).view(rb, g1 - g0, ROWS).transpose(1, 2)
        mn[:, :, g0:g1] = b[:, ms].contiguous().view(torch.bfloat16).view(rb, g1 - g0, ROWS).transpose(1, 2)
    return q.view(n, k), sc.view(n, k // GROUP), mn.view(n, k // GROUP)


def dequantize(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The bf16 weights [n, k] a Q4NX buffer stands for: q * scale + min in f32 (the product is
    exact; the sum rounds once) and rounded to bf16, nearest-even. The NPU's prefill kernels
    multiply these numbers (so do the simulated device's, but on the classes where byte products
    win, `native_cpu.integer_q4nx_gemm`, which apply `gemv_reference`'s contract to every row),
    and the verification reference runs on them."""
    q, sc, mn = unpack(buf, n, k)
    s = sc.float().repeat_interleave(GROUP, dim=1)
    m = mn.float().repeat_interleave(GROUP, dim=1)
    return (q.float() * s + m).to(torch.bfloat16)


FIXED_BITS = 14      # decode's wide activations: a group's largest |x| scaled to below 2^FIXED_BITS
# Decode's activations in one of two widths, bytes per activation (the CPU's byte dot products
# take a byte at a time): WIDE, 14-bit fixed point as two signed bytes, as close to the NPU's bf16
# products as a power-of-two unit gets; NARROW, one signed byte, half the products (the width
# llama.cpp's 4-bit dot products take). A CPU class names its width
# (`native_build.Q4NX_NARROW_ACTIVATIONS`); docs/explain.md has what each costs.
WIDE, NARROW = 2, 1
NARROW_LEVELS = 127  # a narrow group's largest |x| becomes ±NARROW_LEVELS
NARROW_FLOOR_EXP = -120  # a narrow group whose largest |x| is below 2^this counts as zeros (127 / top stays finite)


def fixed_point(x: torch.Tensor, act_bytes: int = WIDE) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of GROUP activations as integers X (f32 holding integer values) and the group's
    unit u, x ~ X * u. A group of zeros has u = 1.

    WIDE: u = 2^(e + 1 - FIXED_BITS) for the group's largest |x| in [2^e, 2^(e+1)), so
    |X| < 2^FIXED_BITS: a bf16 has 8 significant bits, so every x within 2^6 of the largest is
    exact and a smaller one is off by less than u / 2, 2^-14 of the largest. 14 bits, not 15, so
    that X splits into two signed bytes (256 Xh + Xl, both in [-128, 127]) for the CPU's byte dot
    products.

    NARROW: X = round(x * (127 / top)) and u = top / 127 (each an f32 division, so every
    implementation forms the same numbers), |X| <= 127: one signed byte, off by up to u / 2,
    1/254 of the group's largest |x|. A group whose largest |x| is below 2^NARROW_FLOOR_EXP is
    taken as zeros (its 127 / top would overflow f32; its products are below any bf16 output's ulp).
    """
    g = x.float().view(-1, GROUP)
    top = g.abs().amax(1)
    if act_bytes == NARROW:
        live = top >= 2.0 ** NARROW_FLOOR_EXP
        safe = torch.where(live, top, torch.ones_like(top))
        # Tensor over tensor, a true division: torch takes a scalar over a tensor as a reciprocal
        # times the scalar, which rounds twice.
        levels = torch.full_like(top, NARROW_LEVELS)
        r = torch.where(live, levels / safe, torch.zeros_like(top))
        return torch.round(g * r[:, None]), torch.where(live, safe / levels, torch.ones_like(top))
    if act_bytes != WIDE:
        raise ValueError(f"decode's activations are {WIDE} or {NARROW} bytes wide, not {act_bytes}")
    e = torch.frexp(top).exponent - 1             # top in [2^e, 2^(e+1))
    u = torch.where(top > 0, torch.ldexp(torch.ones_like(top), e - (FIXED_BITS - 1)), torch.ones_like(top))
    return torch.round(g / u[:, None]), u


def gemv_reference(buf: torch.Tensor, x: torch.Tensor, n: int, k: int, act_bytes: int = WIDE) -> torch.Tensor:
    """Decode's product y = W x (f32 [n]) for Q4NX W, as the fused kernels compute it.

    Dequantization is folded into the sums: per group, y += (scale * u) * sum(q * X) +
    min * S, with X, u from `fixed_point` and S from `group_sums`. sum(q * X) is an exact
    integer (at most 15 * 2^15 * 32 < 2^24, so even f32 holds it exactly in any order), which is
    why every CPU class of one activation width gets the same bits for it; only the per-group
    combination rounds, in f32.
    """
    q, sc, mn = unpack(buf, n, k)
    X, u = fixed_point(x, act_bytes)
    g = k // GROUP
    sums = torch.einsum("ngc,gc->ng", q.float().view(n, g, GROUP), X.view(g, GROUP))
    return (sums * (sc.float() * u) + mn.float() * group_sums(x, X, u, act_bytes)).sum(1)


def group_sums(x: torch.Tensor, X: torch.Tensor, u: torch.Tensor, act_bytes: int = WIDE) -> torch.Tensor:
    """The sum each group's min multiplies (f32 [groups]): wide, the exact sum of x in element
    order; narrow, u * sum(X), the sum of the activations as the byte products see them.

    Narrow needs it: w = q * scale + min with q in 0..15 is a large positive q * scale that
    the min cancels, so the error of the bytes, seen by q * scale, must be seen by the min too,
    or the cancellation leaves it whole (`make perplexity` on the embedded model: +1.9 % over
    bf16 with the exact sum, +0.9 % this way; llama.cpp's 8-bit activations carry the same sum
    for the same reason). At 14 bits that error is 2^6 times smaller, and the wide contract keeps the exact
    sum, as the NPU's bf16 products have it.
    """
    if act_bytes == NARROW:
        return X.view(-1, GROUP).sum(1) * u
    return x.float().view(-1, GROUP).sum(1)
