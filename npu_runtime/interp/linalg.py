"""`linalg.generic` over its whole iteration space at once, with numpy.

Each operand is gathered through its indexing map into an array that broadcasts over the
iteration space, the body's scalar ops then run once on those arrays, and the yielded value
is scattered back through the output's map. A reduction of the form the builders emit,
`yield out + X` (X free of `out`), becomes `out + sum(X over the reduction dims)`, so f32 sums
are taken in numpy's (pairwise) order rather than one element after another; the verify-mlir
tolerance accounts for that. Any other reduction (a maximum, several outputs, a body that
reads the accumulator) runs the body once per point of the reduction dims, in their
lexicographic order, over all parallel dims at once, carrying the outputs from one point to
the next as the loop nest would.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from npu_runtime.interp.program import Block, Op


def _space(op: Op, bufs: list) -> list[int]:
    maps = op.attrs["indexing_maps"]
    n_dims = maps[0][0]
    sizes = [0] * n_dims
    for (_, results), buf in zip(maps, bufs):
        for pos, r in enumerate(results):
            if isinstance(r, int):
                if sizes[r] and sizes[r] != buf.shape[pos]:
                    raise ValueError(f"loop dim d{r} is {sizes[r]} for one operand and {buf.shape[pos]} for another")
                sizes[r] = buf.shape[pos]
    if 0 in sizes:
        raise ValueError("a loop dimension no operand defines")
    return sizes


def _index(results: list, sizes: list[int], at: dict[int, int] | None = None) -> tuple:
    """Indices of a map's results over the iteration space; loop dims in `at` fixed at that point."""
    n, at = len(sizes), at or {}
    return tuple(int(r) if not isinstance(r, int) else at[r] if r in at
                 else np.arange(sizes[r]).reshape([-1 if k == r else 1 for k in range(n)]) for r in results)


def generic(op: Op, ins: list, outs: list, env: list, run_block: Callable[[Block, list], None]) -> bool:
    """Run the op on `ins` / `outs` (interpreter Buffers), writing `outs`. True if the body read `outs`."""
    maps, iterators = op.attrs["indexing_maps"], op.attrs["iterator_types"]
    sizes = _space(op, ins + outs)
    body = op.regions[0]
    yield_op = body.ops[-1]
    if yield_op.name != "linalg.yield" or len(yield_op.operands) != len(outs):
        raise ValueError("linalg.generic body does not end in a yield of every output")
    for arg, (_, results), buf in zip(body.args, maps, ins + outs):
        env[arg] = buf.data.reshape(buf.shape)[_index(results, sizes)]
    reduce_axes = tuple(i for i, t in enumerate(iterators) if t == "reduction")
    out_args = body.args[len(ins):]
    if not reduce_axes:
        run_block(body, env)
        for vid, (_, results), buf in zip(yield_op.operands, maps[len(ins):], outs):
            _scatter(buf, results, sizes, np.broadcast_to(env[vid], sizes))
        return any(a in o.operands for a in out_args for o in body.ops)
    summed_form = _sum_of_terms(body, out_args[0], yield_op) if len(outs) == 1 else None
    if summed_form is None:
        _loop_reduction(op, ins, outs, env, run_block, sizes, reduce_axes)
        return True
    term, partial = summed_form
    run_block(partial, env)
    summed = np.broadcast_to(env[term], sizes).sum(axis=reduce_axes, keepdims=True, dtype=np.float32)
    out = outs[0]
    current = out.data.reshape(out.shape)[_index(maps[-1][1], sizes)]
    _scatter(out, maps[-1][1], sizes, current + summed)
    return True


def _sum_of_terms(body: Block, out_arg: int, yield_op: Op) -> tuple[int, Block] | None:
    """For a body that yields `out + X` with X free of `out`: X's value and the ops computing it."""
    final = next((o for o in body.ops if yield_op.operands[0] in o.results), None)
    if final is None or final.name != "arith.addf" or out_arg not in final.operands:
        return None
    partial = Block(body.args, [o for o in body.ops if o is not final and o is not yield_op])
    if any(out_arg in o.operands for o in partial.ops):
        return None
    return final.operands[1] if final.operands[0] == out_arg else final.operands[0], partial


def _loop_reduction(op: Op, ins: list, outs: list, env: list, run_block: Callable[[Block, list], None],
                    sizes: list[int], reduce_axes: tuple[int, ...]) -> None:
    """The reduction dims as a sequential loop, the parallel dims at once; outputs carried between points."""
    maps, body = op.attrs["indexing_maps"], op.regions[0]
    yield_op = body.ops[-1]
    out_maps = [results for _, results in maps[len(ins):]]
    shape = [1 if i in reduce_axes else n for i, n in enumerate(sizes)]
    acc = [buf.data.reshape(buf.shape)[_index(results, sizes, {d: 0 for d in reduce_axes})]
           for buf, results in zip(outs, out_maps)]
    for point in itertools.product(*(range(sizes[d]) for d in reduce_axes)):
        at = dict(zip(reduce_axes, point))
        for arg, (_, results), buf in zip(body.args, maps, ins):
            env[arg] = buf.data.reshape(buf.shape)[_index(results, sizes, at)]
        for arg, value in zip(body.args[len(ins):], acc):
            env[arg] = value
        run_block(body, env)
        acc = [np.broadcast_to(env[vid], shape).astype(buf.data.dtype)
               for vid, buf in zip(yield_op.operands, outs)]
    for buf, results, value in zip(outs, out_maps, acc):
        _scatter(buf, results, shape, value)


def _scatter(buf, results: list, sizes: list[int], value: np.ndarray) -> None:
    view = buf.data.reshape(buf.shape)
    idx = _index(results, sizes)
    target_shape = view[idx].shape
    view[idx] = np.asarray(value).astype(buf.data.dtype, copy=False).reshape(target_shape)
