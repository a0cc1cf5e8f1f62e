"""What every per-kernel builder shares: the launch's view of its slots and the outer hierarchy.

A builder gets one `groups.Launch` and the `Slot`s behind its arguments (`launch.args`
order: reads, then writes) and returns a complete module whose function takes exactly those
arguments as L3 memrefs. Shapes come from the slots, tilings from the launch parameters;
nothing here knows a model dimension.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.emit import Emitter, Hierarchy, Index, Pattern, Value, memref, memref_parts


class KernelShapeError(ValueError):
    """A launch's parameters and its slot shapes do not give a legal kernel."""


def slot_type(slot: Slot) -> str:
    """A slot's L3 memref: its storage (the bytes, for a quantized matrix), so the module's
    argument is exactly the buffer the host uploads."""
    return memref(slot.storage_shape, slot.element_type)


@dataclass(frozen=True)
class Kernel:
    launch: Launch
    slots: tuple[Slot, ...]

    def p(self, key: str) -> Any:
        return self.launch.p(key)

    def require(self, cond: bool, msg: str) -> None:
        if not cond:
            raise KernelShapeError(f"launch {self.launch.name!r} ({self.launch.op}): {msg}")

    def herd(self) -> tuple[int, int]:
        h = tuple(self.p("herd"))
        self.require(len(h) == 2 and all(d >= 1 for d in h), f"herd {h} is not two positive sizes")
        return h  # type: ignore[return-value]


def kernel(launch: Launch, slots: Sequence[Slot], n_reads: int, n_writes: int) -> Kernel:
    k = Kernel(launch, tuple(slots))
    k.require(len(launch.reads) == n_reads and len(launch.writes) == n_writes,
              f"expects {n_reads} reads and {n_writes} writes, got {launch.reads} -> {launch.writes}")
    k.require(len(slots) == len(launch.args), f"{len(slots)} slots for {len(launch.args)} arguments")
    return k


@contextmanager
def module(k: Kernel) -> Iterator[tuple[Emitter, list[Value]]]:
    """The sub-module's function: named after the launch, one L3 memref per launch argument."""
    b = Emitter()
    with b.function(k.launch.name, [slot_type(s) for s in k.slots]) as args:
        yield b, args


@contextmanager
def launch_segment(b: Emitter, k: Kernel, args: Sequence[Value]) -> Iterator[Hierarchy]:
    """A single-iteration launch and its segment, both forwarding every argument by slot name."""
    hints = [s.name for s in k.slots]
    with b.hierarchy("launch", [], args, hints) as lh:
        with b.hierarchy("segment", [], lh.args, hints) as sh:
            yield sh


@contextmanager
def single_herd(b: Emitter, k: Kernel, args: Sequence[Value], herd: tuple[int, int] | None = None) -> Iterator[Hierarchy]:
    """launch → segment → herd over `herd` (default `k.herd()`, the launch's), with every
    argument passed down unchanged."""
    hx, hy = herd or k.herd()
    with launch_segment(b, k, args) as sh:
        with b.hierarchy("herd", [hx, hy], sh.args, [s.name for s in k.slots]) as hh:
            yield hh


def core_index(b: Emitter, h: Hierarchy, herd: tuple[int, int]) -> Index:
    """Linear core number, row-major over (x, y); a 1-wide dimension contributes nothing."""
    tx, ty = h.ids
    if herd == (1, 1):
        return 0
    if herd[1] == 1:
        return tx
    return b.add(b.mul(tx, herd[1]), ty)


def deal_items(b: Emitter, cores: int, items: int, core: Index, body: Callable[[Index], None]) -> None:
    """`body(item)` for every work item dealt to this core, round-robin: item = round·cores +
    core, for each round that holds one (no loop when one round deals them all, no guard when
    the cores divide them)."""
    rounds = -(-items // cores)
    if rounds == 1:
        with b.if_(b.cmp("ult", core, items)) if cores > items else nullcontext():
            body(core)
        return
    with b.loop(0, rounds, 1, "round") as rnd:
        i = b.add(b.mul(rnd, cores), core)
        with b.if_(b.cmp("ult", i, items)) if rounds * cores != items else nullcontext():
            body(i)


def flat_pattern(b: Emitter, shape: tuple[int, ...], start: Index, n: int) -> Pattern:
    """`n` consecutive elements from flat offset `start` of a row-major 1-D or 2-D buffer.

    This is what lets one elementwise kernel serve [rows, features] prefill slots and
    [features] decode slots: the herd walks a flat index space and the DMA turns it back into
    (row, column) when the buffer is 2-D. The caller guarantees a chunk never crosses a row.
    """
    if len(shape) == 1:
        return [start], [n], [1]
    cols = shape[-1]
    return [b.div(start, cols), b.rem(start, cols)], [1, n], [cols, 1]


def row_pattern(shape: tuple[int, ...], row: Index, col: Index, n: int) -> Pattern:
    """`n` elements of one row starting at column `col` (a 1-D buffer is its single row)."""
    if len(shape) == 1:
        return [col], [n], [1]
    return [row, col], [1, n], [shape[-1], 1]


def round_to_bf16(b: Emitter, acc: Value, out: Value) -> None:
    """out = bf16(acc), elementwise over a tile of any rank: the one rounding of an f32 result."""
    rank = len(memref_parts(acc.type)[0])
    dims = ", ".join(f"d{i}" for i in range(rank))
    ident = f"affine_map<({dims}) -> ({dims})>"
    b.generic([ident, ident], ["parallel"] * rank, [acc], [out], lambda x: [b.truncf(x[0])])
