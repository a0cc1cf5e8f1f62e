"""`linalg.generic` over its whole iteration space at once, with numpy.

Each operand is gathered through its indexing map into an array that broadcasts over the
iteration space, the body's scalar ops then run once on those arrays, and the yielded value
is scattered back through the output's map. A reduction must have the form the builders
emit, `yield out + X` (X free of `out`): it becomes `out + sum(X over the reduction dims)`, so
f32 sums are taken in numpy's (pairwise) order rather than one element after another; the
verify-mlir tolerance accounts for that.
"""
from __future__ import annotations

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


def _index(results: list, sizes: list[int]) -> tuple:
    n = len(sizes)
    return tuple(np.arange(sizes[r]).reshape([-1 if k == r else 1 for k in range(n)]) if isinstance(r, int)
                 else int(r) for r in results)


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
    if len(outs) != 1:
        raise NotImplementedError("a reduction with more than one output")
    final = next((o for o in body.ops if yield_op.operands[0] in o.results), None)
    if final is None or final.name != "arith.addf" or out_args[0] not in final.operands:
        raise NotImplementedError("a reduction whose body is not `yield out + x`")
    term = final.operands[1] if final.operands[0] == out_args[0] else final.operands[0]
    partial = Block(body.args, [o for o in body.ops if o is not final and o is not yield_op])
    if any(out_args[0] in o.operands for o in partial.ops):
        raise NotImplementedError("a reduction body that reads the accumulator other than to add to it")
    run_block(partial, env)
    summed = np.broadcast_to(env[term], sizes).sum(axis=reduce_axes, keepdims=True, dtype=np.float32)
    out = outs[0]
    current = out.data.reshape(out.shape)[_index(maps[-1][1], sizes)]
    _scatter(out, maps[-1][1], sizes, current + summed)
    return True


def _scatter(buf, results: list, sizes: list[int], value: np.ndarray) -> None:
    view = buf.data.reshape(buf.shape)
    idx = _index(results, sizes)
    target_shape = view[idx].shape
    view[idx] = np.asarray(value).astype(buf.data.dtype, copy=False).reshape(target_shape)
