"""The KV cache and the host ops that read and write it: the row store and decode attention.

Both run on the CPU on every device (the call-by-call decode runs them between device calls;
the recorded decode replays their native calls, `native_calls`). Like the device's launches,
they are tested against `verify.reference`, which states where bf16 rounds.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import psutil
import torch

from cpu_kernels import native_cpu
from llama_base.config import LlamaConfig
from llama_base.errors import ContextError
from llama_base.memory import untouched_zeros


# Positions a run's KV cache holds unless it asks for more (MAX_CONTEXT): pages are committed as
# they are written, so this bounds a sequence, not the memory a short one uses.
DEFAULT_MAX_CONTEXT = 4096


def kv_cache_bytes(cfg: LlamaConfig, positions: int) -> int:
    """Bytes of K and V for `positions` in every layer and KV head, bf16."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * positions * cfg.head_dim * 2


def context_positions(cfg: LlamaConfig, asked: int | None, default: int = DEFAULT_MAX_CONTEXT) -> int:
    """The KV cache length a run gets: `asked` if the model and the machine can hold it, else a
    one-line `ContextError` before anything is loaded; `default` (capped at the model's limit)
    when nothing was asked. The cache's pages are committed only as positions are written, so
    a cache that does not fit would fail far into a long answer: the check is made up front,
    against the memory the machine has available now."""
    limit = cfg.max_position_embeddings
    if asked is None:
        return min(default, limit)
    if asked < 1:
        raise ContextError(f"MAX_CONTEXT={asked}: a context holds at least one position")
    if asked > limit:
        raise ContextError(f"MAX_CONTEXT={asked} is past this model's limit of {limit} positions "
                           f"(max_position_embeddings)")
    need, free = kv_cache_bytes(cfg, asked), psutil.virtual_memory().available
    if need > free:
        raise ContextError(f"MAX_CONTEXT={asked}: its KV cache needs {need / 2**30:.2f} GiB "
                           f"({cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} "
                           f"x 2 bytes, K and V, a position), and {free / 2**30:.2f} GiB are available")
    return asked


# Bound decode steps a cache keeps: one per layer's buffer set, with room for a model whose
# layers come in several group variants.
_BOUND_STEPS = 256


# The host op a decode layer's KV store and attention are profiled as (`store_and_attend`).
HOST_OP = "kv_write+attention"


class TokenPrefix:
    """Which token every cached position holds, from position 0: what lets a prompt that
    begins with them skip their prefill. The step functions keep it true (`invalidate` before
    they write, `hold` once every layer is written), so a step cut short leaves only what is
    whole. The KV itself is elsewhere: on the host (`KVCache`) or resident on the device
    (`ResidentKV`)."""

    def __init__(self, max_seq: int):
        self.max_seq = max_seq
        self.token_ids: list[int] = []

    def invalidate(self, start: int) -> None:
        """Positions from `start` on are about to be rewritten: they no longer hold known tokens."""
        del self.token_ids[start:]

    def hold(self, start: int, ids: Sequence[int]) -> None:
        """Every layer's K/V of `ids` are now at start..; recorded when they continue the known
        prefix (a write past a gap says nothing about the positions in between)."""
        if len(self.token_ids) == start:
            self.token_ids.extend(ids)


class ResidentKV(TokenPrefix):
    """The bookkeeping of a KV cache resident on the device (`Role.STATE` buffers the
    KernelCache owns): `max_seq` positions a sequence may use of the buffers' `capacity`
    (the rest holds a last prefill chunk's padding rows), and `nbytes` of them."""

    def __init__(self, max_seq: int, capacity: int, nbytes: int):
        super().__init__(max_seq)
        self.capacity, self.nbytes = capacity, nbytes


class KVCache(TokenPrefix):
    """Head-major K/V for every layer: [layers, kv_heads, max_seq, head_dim], bf16, and the
    token each position holds.

    Head-major keeps each head's keys contiguous over positions, so single-query decode
    attention reads positions 0..pos of a head as one strided block. `token_ids` lists, from
    position 0, the tokens whose K/V every layer holds: a prompt that begins with them need
    not be prefilled again. The step functions keep it true (`invalidate` before they write,
    `hold` once every layer is written), so a step cut short leaves only what is whole.
    """

    def __init__(self, layers: int, kv_heads: int, max_seq: int, head_dim: int):
        super().__init__(max_seq)
        shape = (layers, kv_heads, max_seq, head_dim)
        self.k = untouched_zeros(shape, torch.bfloat16)
        self.v = untouched_zeros(shape, torch.bfloat16)
        self.layers = layers
        self._steps: dict[int, tuple] = {}   # id of a query view -> its bound native step (`store_and_attend`)
        self._k_ptr, self._v_ptr = self.k.data_ptr(), self.v.data_ptr()
        self._attn_out: torch.Tensor | None = None   # what `store_and_attend` returns, rewritten by each call

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, start: int, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Store token-major rows [n, kv_heads·d] at positions start..start+n."""
        n = k_rows.shape[0]
        if start + n > self.max_seq:
            raise IndexError(f"KV cache holds {self.max_seq} positions; writing {start}..{start + n}")
        kvh, d = self.k.shape[1], self.k.shape[3]
        # A decode step's one row: by pointer where the CPU allows, as indexing costs more than the 2 KiB.
        if n == 1 and native_cpu.kv_store_row(k_rows, v_rows, self.k, self.v, layer, start):
            return
        self.k[layer, :, start:start + n].copy_(k_rows.view(n, kvh, d).transpose(0, 1))
        self.v[layer, :, start:start + n].copy_(v_rows.view(n, kvh, d).transpose(0, 1))

    def store_and_attend(self, layer: int, pos: int, q: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor,
                         n_heads: int) -> torch.Tensor:
        """A decode step's host work in one layer: store the token's K/V rows at `pos`, then its
        query's attention over positions 0..pos (`decode_attention_cpu`).

        Natively, with the rows' addresses checked once per tensor: a decode step passes the
        same output views of its device call every time, and between two GEMVs each check,
        view and allocation costs microseconds from cold caches (docs/profile.md, "Around the
        calls"). The result is a buffer the next call overwrites."""
        if not (0 <= pos < self.max_seq and 0 <= layer < self.layers):
            raise IndexError(f"KV cache holds {self.layers} layers of {self.max_seq} positions; "
                             f"writing layer {layer} at {pos}")
        step = self._steps.get(id(q))
        if step is None or step[0] is not q or step[1] is not k_row or step[2] is not v_row:
            step = self._bind_step(q, k_row, v_row, n_heads)
        if step[3] is None:
            self.write(layer, pos, k_row.view(1, -1), v_row.view(1, -1))
            return decode_attention_cpu(q, self, layer, pos, n_heads)
        store, attend, out = step[3][:3]
        store_args, attend_args = self._native_args(step[3], layer, pos)
        store(*store_args)
        attend(*attend_args)
        return out

    def native_calls(self, layer: int, q: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor,
                     n_heads: int) -> tuple[list[tuple[Callable, tuple, tuple]], torch.Tensor] | None:
        """`store_and_attend(layer, pos, ...)` as native calls for whatever position it runs at:
        each (function, its arguments at position 0, their steps per position: the row's
        address and the attention's length follow the position), and the tensor the attention
        writes; None where the step has no native form. What a recorded decode token makes of
        this layer's host op (`engine.recording`); it must not run past the cache."""
        if not 0 <= layer < self.layers:
            raise IndexError(f"KV cache holds {self.layers} layers; recording layer {layer}")
        state = self._bind_step(q, k_row, v_row, n_heads)[3]
        if state is None:
            return None
        # The arguments are linear in the position: each one's step is its value at 1 less at 0.
        at0, at1 = self._native_args(state, layer, 0), self._native_args(state, layer, 1)
        return [(fn, a0, tuple(b - a for a, b in zip(a0, a1))) for fn, a0, a1 in zip(state[:2], at0, at1)], state[2]

    def _native_args(self, state: tuple, layer: int, pos: int) -> tuple[tuple, tuple]:
        """The native KV row store's and attention's arguments for `layer` at `pos`, from a bound
        step's state (`_bind_step`): one place for the pointer arithmetic both the call-by-call
        step and its recording use."""
        _, _, _, out_ptr, q_ptr, k_ptr, v_ptr, layer_bytes, row_bytes, heads, kvh, d = state
        kc = self._k_ptr + layer * layer_bytes
        vc = self._v_ptr + layer * layer_bytes
        return ((k_ptr, v_ptr, kc + pos * row_bytes, vc + pos * row_bytes, kvh, d, self.max_seq),
                (q_ptr, kc, vc, out_ptr, heads, kvh, d, pos + 1, self.max_seq))

    def _bind_step(self, q: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor, n_heads: int) -> tuple:
        """(q, k_row, v_row, native state or None), kept per query view: each layer's device
        buffers have views of their own. The entry holds the tensors it was bound for, so their
        addresses stay theirs."""
        _, kvh, stride, d = self.k.shape
        out = self._attn_out
        if out is None or out.numel() != n_heads * d:
            out = self._attn_out = torch.empty(n_heads * d, dtype=torch.bfloat16)
        calls = native_cpu.decode_step_calls(q, k_row, v_row, self.k, self.v, out)
        state = None
        if calls is not None:
            row_bytes = d * self.k.element_size()
            state = (*calls, out, out.data_ptr(), q.data_ptr(), k_row.data_ptr(), v_row.data_ptr(),
                     kvh * stride * row_bytes, row_bytes, n_heads, kvh, d)
        if len(self._steps) >= _BOUND_STEPS:
            self._steps.clear()
        step = self._steps[id(q)] = (q, k_row, v_row, state)
        return step


def decode_attention_cpu(q: torch.Tensor, cache: KVCache, layer: int, pos: int, n_heads: int) -> torch.Tensor:
    """Single-query GQA attention of the token at `pos` over cached positions 0..pos (inclusive).

    Reads exactly those positions (never the rest of the cache). Natively where the CPU allows
    (`native_cpu.decode_attention`: one pass per head, no temporaries); otherwise two batched
    f32 matmuls over the KV heads, with each head's query group as the rows, which for one
    query is several times faster than torch's fused attention (it expands K/V for GQA).
    """
    out = torch.empty(q.numel(), dtype=torch.bfloat16)
    if native_cpu.decode_attention(q.reshape(-1), cache.k[layer], cache.v[layer], pos + 1, out):
        return out
    kvh, d = cache.k.shape[1], cache.k.shape[3]
    k = cache.k[layer, :, : pos + 1].float()
    v = cache.v[layer, :, : pos + 1].float()
    qh = q.view(kvh, n_heads // kvh, d).float()
    scores = torch.matmul(qh, k.transpose(1, 2)).mul_(1.0 / math.sqrt(d))
    return torch.matmul(torch.softmax(scores, -1), v).reshape(n_heads * d).to(torch.bfloat16)
