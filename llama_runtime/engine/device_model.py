"""A model resident on a device: compiled groups, per-layer BO sets, host tables and the KV cache.

This is the state the prefill and decode step functions share. Building it compiles (or
loads from the kernel cache) every group, uploads every layer's weights once, and keeps on
the host only what host ops need: the embedding table (read row by row) and the final norm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cpu_kernels import native_cpu
from kernel_builder.groups import build_group, context_bucket, lm_head_gemv, prefill_buckets
from llama_base.group_contract import DECODE_KINDS, PREFILL_KINDS, KernelGroup, Role
from llama_base.config import LlamaConfig
from llama_base.errors import KernelCacheError, PromptError
from llama_runtime.engine.head_rescore import ROW_CACHE_BYTES, TOP_K, rescore
from kernel_builder.fused_groups import FINAL_NORM_SLOT, cache_capacity, fused_decode, resident_flash_attn, window_for
from llama_runtime.engine.kv_cache import KVCache, ResidentKV, TokenPrefix, context_positions, kv_cache_bytes
from llama_base.rope import generate_rope_lut
from llama_runtime.engine.weight_slots import static_tensors
from llama_runtime.checkpoints.safetensors_io import FileRows
from llama_runtime.checkpoints.weights import LlamaWeights
from npu_runtime.cache import KernelCache
from npu_runtime.profiler import NULL_PROFILER, Profiler

# capture(layer, name, tensor): verification hooks; tensors are views, copy what you keep.
Capture = Callable[[int, str, torch.Tensor], None]


# The host op the final RMSNorm is profiled as, by the loop and by the recorded decode.
FINAL_NORM = "final_norm"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """f32 statistics; the normalised row rounded to bf16, then its product with the weight
    rounded again: HF's rounding points, which the device RMSNorm launch also follows."""
    out = torch.empty_like(x)
    if native_cpu.rmsnorm(x.contiguous(), weight.contiguous(), out, x.shape[-1], eps):
        return out
    xf = x.float()
    return F.rms_norm(xf, (xf.shape[-1],), eps=eps).to(torch.bfloat16) * weight.to(torch.bfloat16)


def bo_key(group: KernelGroup, layer: int | None) -> str:
    return group.name if layer is None else f"{group.name}_L{layer}"


DECODE_MODES = ("layers", "fused")


def choose_decode(asked: str) -> str:
    """`asked`, or for "auto" the decode that is faster, which is the fused one on every device:
    on the NPU the cost model prices its token at one call where the card's makes 33, with
    attention on the array (docs/profile.md, "The fused decode"); on the simulated device both
    are one recorded native program of the same kernels, and the fused one measures as fast at
    short contexts (docs/profile.md) and reads the same positions at long ones."""
    if asked == "auto":
        return "fused"
    if asked not in DECODE_MODES:
        raise ValueError(f"decode {asked!r}: expected auto or one of {', '.join(DECODE_MODES)}")
    return asked


# The share key of the LM head's buffers (and the fused group's other non-layer weights).
HEAD_SHARE = "head"


class _ResidentStatics(dict):
    """A fused group's static tensors: its final norm; every other weight it names is already
    resident in a layer's or the head's set, and one that is not is a bug, not an upload."""

    def __init__(self, group: KernelGroup, final_norm: torch.Tensor):
        super().__init__({FINAL_NORM_SLOT: final_norm})
        self._group = group

    def __missing__(self, name: str) -> torch.Tensor:
        raise KernelCacheError(f"{self._group.name}.{name}: not resident in any layer's or the head's buffers")


@dataclass
class PrefillGroups:
    rms_gemms_rope: KernelGroup
    flash_attn: KernelGroup
    o_ffn: KernelGroup


def _row_reader(table: torch.Tensor, weights: LlamaWeights | None,
                cache_bytes: int = 0) -> FileRows | Callable[[torch.Tensor], torch.Tensor]:
    """Rows of a bf16 table by id (embedding lookups, a quantized head's rescored candidates):
    read from the checkpoint file where the table is a view of it (`FileRows`: only a cache of
    up to `cache_bytes` of recent rows stays resident), else gathered from the tensor."""
    while weights is not None:
        reader = weights.checkpoint.rows_of(table, cache_bytes) if weights.checkpoint is not None else None
        if reader is not None:
            return reader
        weights = weights.backing
    return lambda idx: table.index_select(0, idx)


class DeviceModel:
    """`decode`: "layers", the design card's (2 calls a layer, the KV cache and attention on
    the host), or "fused" (`kernel_builder.fused_groups`: one call a token, the KV cache
    resident on the device, where prefill's attention appends to it)."""

    def __init__(self, kc: KernelCache, weights: LlamaWeights, max_context: int,
                 buckets: tuple[int, ...] | None = None, profiler: Profiler | None = None,
                 decode: str = "layers"):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode {decode!r}: expected one of {', '.join(DECODE_MODES)}")
        cfg = weights.config
        max_context = context_positions(cfg, max_context)   # the check `build_session` makes before loading
        self.config: LlamaConfig = cfg
        self.kc = kc
        self.profiler = profiler or NULL_PROFILER
        self.max_context = max_context
        self.buckets = tuple(buckets) if buckets else prefill_buckets(cfg, max_context)
        self.quant = weights.quant
        self.decode = decode
        self.resident = decode == "fused"
        self.layer_wide = [weights.wide(i) for i in range(cfg.num_hidden_layers)]
        # A resident cache has room past the context for a last prefill chunk's padding rows.
        self.capacity = cache_capacity(cfg, max_context, self.buckets[-1]) if self.resident else 0

        def prefill_kinds(s: int, w) -> PrefillGroups:
            g = [build_group(k, cfg, s, quant=self.quant, wide=w) for k in PREFILL_KINDS]
            if self.resident:
                g[1] = resident_flash_attn(cfg, s, self.capacity, window_for(s, self.capacity))
            return PrefillGroups(*g)

        # Each layer's groups, by bucket (prefill) or kind (decode): one object per variant, the
        # same for every layer unless some hold weights in bf16 (`LlamaWeights.wide`).
        prefill = {w: {s: prefill_kinds(s, w) for s in self.buckets} for w in weights.wide_sets()}
        decode_kinds = () if self.resident else DECODE_KINDS
        decode_groups = {w: {k: build_group(k, cfg, quant=self.quant, wide=w) for k in decode_kinds}
                         for w in weights.wide_sets()}
        self.prefill_groups: dict[int, list[PrefillGroups]] = {
            s: [prefill[w][s] for w in self.layer_wide] for s in self.buckets}
        self.decode_groups: list[dict[str, KernelGroup]] = [decode_groups[w] for w in self.layer_wide]
        self.lm_head = lm_head_gemv(cfg, self.quant)
        self._extra: dict[str, KernelGroup] = {}
        # The fused decode's groups by window (`fused_groups.decode_windows`), each compiled
        # when a token first needs it; the first window's at once.
        self._fused: dict[int, KernelGroup] = {}
        for g in self.all_groups():
            kc.compile_and_cache(g)
        self.final_norm = weights.final_norm
        self._preload(weights)
        self.embed = weights.embed
        # A quantized head's leading logits are recomputed from its bf16 rows (`head_rescore`);
        # `rescore_k` 0 turns that off (a bf16 head is exact already).
        self.embed_rows = _row_reader(weights.embed, weights)
        self.head_rows = (_row_reader(weights.backing.lm_head, weights.backing, ROW_CACHE_BYTES)
                          if weights.backing is not None else None)
        self.rescore_k = TOP_K if self.head_rows is not None else 0
        if self.rescore_k and isinstance(self.head_rows, FileRows):
            self.head_rows.prefetch()     # after the weights' load, so as not to compete with it
        # A context shorter than the smallest bucket still prefills a whole bucket's rows (the
        # padding included), so the cache and the RoPE table hold at least that many positions;
        # `max_context` alone bounds the tokens a sequence may have.
        positions = max(max_context, self.buckets[-1])
        if self.resident:
            self.kv: TokenPrefix = ResidentKV(positions, self.capacity, kv_cache_bytes(cfg, self.capacity))
        else:
            self.kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, positions, cfg.head_dim)
        self.rope_lut = generate_rope_lut(cfg, positions)
        # Decode's token as one native program where the device records runs
        # (`recording.decode_program`); False keeps every token on the call-by-call loop.
        self.native_decode = True
        # (storage key, {window group or None: program}), `recording`'s
        self.recorded_decode: tuple[tuple, dict] | None = None

    def layer_groups(self, layer: int) -> list[KernelGroup]:
        """The groups `layer` runs: every bucket's prefill kinds and the decode kinds."""
        out = [g for pg in self.prefill_groups.values() for g in (pg[layer].rms_gemms_rope, pg[layer].flash_attn,
                                                                   pg[layer].o_ffn)]
        return out + list(self.decode_groups[layer].values())

    def all_groups(self) -> list[KernelGroup]:
        """Every distinct group, each once (layers of one variant share its objects)."""
        out = {g.name: g for layer in range(self.config.num_hidden_layers) for g in self.layer_groups(layer)}
        return list(out.values()) + [self.lm_head] + list(self._fused.values())

    @property
    def calls_per_token(self) -> int:
        """Device calls a decode token makes: one fused call, or two a layer and the LM head."""
        return 1 if self.resident else 2 * self.config.num_hidden_layers + 1

    def describe_decode(self) -> str:
        """The one line a run prints about its decode."""
        if self.resident:
            return (f"fused: 1 device call a token (every layer, the KV cache resident on the device at "
                    f"{self.max_context} positions, attention on the device)")
        return (f"layers: {self.calls_per_token} device calls a token (2 a layer and the LM head), "
                "the KV cache and attention on the host")

    def _preload(self, weights: LlamaWeights) -> None:
        """Every layer's weights into its own BO sets, once; the phases share each weight's BO.

        The LM head goes first, its file pages dropped before the layers load: it is the largest
        single weight, so the checkpoint pages resident beside the device copies never exceed
        one layer's."""
        self.kc.preload(self.lm_head.name, bo_key(self.lm_head, None), static_tensors(self.lm_head, weights, None),
                        share_key=HEAD_SHARE)
        weights.release_pages()
        for layer in range(self.config.num_hidden_layers):
            for g in self.layer_groups(layer):
                self.kc.preload(g.name, bo_key(g, layer), static_tensors(g, weights, layer), share_key=f"L{layer}")
            weights.release_pages()
        if self.resident:
            self.fused_group(0)

    def fused_group(self, pos: int) -> KernelGroup:
        """The fused decode group of the token at `pos`: the smallest window that holds it,
        compiled on first use. Every weight is already resident (the layers' and the head's
        sets): only the final norm is uploaded, once; the rest, and the KV cache, are those
        buffers (`KernelCache.shared_slot`)."""
        window = window_for(pos + 1, self.capacity)
        g = self._fused.get(window)
        if g is None:
            g = fused_decode(self.config, self.capacity, self.quant, self.layer_wide, window)
            self.kc.compile_and_cache(g)
            self.kc.preload(g.name, bo_key(g, None), _ResidentStatics(g, self.final_norm), share_key=HEAD_SHARE)
            self._fused[window] = g
        return g

    def bucket_for(self, n: int) -> int:
        for s in self.buckets:
            if n <= s:
                return s
        raise PromptError(f"{n} tokens exceed the largest prefill bucket ({self.buckets[-1]})")

    def attention_group(self, seq: int, start: int, n: int) -> KernelGroup:
        """The attention group for a chunk of `n` real rows (bucket `seq`) starting at `start`.

        A fresh prompt uses the bucket's own group; a chunk after cached positions needs a
        longer context, compiled on first use (once per power-of-two context length).
        """
        if start == 0:
            return self.prefill_groups[seq][0].flash_attn
        if self.resident:       # the window holding the chunk's padded rows, which it appends
            g = resident_flash_attn(self.config, seq, self.capacity, window_for(start + seq, self.capacity))
        else:
            ctx = max(seq, context_bucket(start + n, self.buckets[0], self.max_context))
            g = build_group("flash_attn", self.config, seq, ctx)
        if g.name not in self._extra:
            self.kc.compile_and_cache(g)
            for layer in range(self.config.num_hidden_layers):   # the layer's KV cache, if resident
                self.kc.preload(g.name, bo_key(g, layer), {}, share_key=f"L{layer}")
            self._extra[g.name] = g
        return self._extra[g.name]

    # ---- host ops -------------------------------------------------------------------------
    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        with self.profiler.host_op("embedding"):
            self._check_ids(ids)
            return self.embed_rows(torch.tensor(ids, dtype=torch.long))

    def embed_into(self, token: int, out: torch.Tensor) -> bool:
        """The embedding row of `token` read straight into `out` (a recorded decode step's input
        row), with no tensor made on the way; False, nothing read, where the table is not read
        from its file natively (`embed_tokens` serves)."""
        if not isinstance(self.embed_rows, FileRows):
            return False
        with self.profiler.host_op("embedding"):
            self._check_ids([token])
            return self.embed_rows.read_into(token, out)

    def _check_ids(self, ids: list[int]) -> None:
        v = self.config.vocab_size
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the model's vocabulary of {v}")

    def logits(self, hidden_row: torch.Tensor, capture=None) -> torch.Tensor:
        """Final RMSNorm on one row (host), then the LM head as one 8-partition GEMV call (and a
        quantized head's leading logits recomputed on the host, `head_rescore`)."""
        with self.profiler.host_op(FINAL_NORM):
            h = rms_norm(hidden_row, self.final_norm, self.config.rms_norm_eps)
        if capture:
            capture(-1, "final_normed", h)
        out = self.kc.load_and_run(self.lm_head.name, {"x": h}, bo_key(self.lm_head, None))
        return self.head_logits(torch.cat([out[name] for name in self.head_parts()]), h)

    def head_parts(self) -> list[str]:
        """The LM head's output slots in vocabulary order: its logits are their concatenation."""
        return [slot.name for slot in self.lm_head.with_role(Role.OUTPUT)]

    def head_logits(self, parts: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """f32 logits from the head's concatenated bf16 partitions (`parts`, padded past the
        vocabulary) for the final-normed row `normed`, a quantized head's leading ones rescored
        (the widening done in the same native call, `head_rescore.rescore`)."""
        if not self.rescore_k:
            return parts[: self.config.vocab_size].float()
        logits = torch.empty(self.config.vocab_size, dtype=torch.float32)
        with self.profiler.host_op("head_rescore"):
            rescore(logits, normed, self.head_rows, self.rescore_k, source=parts[: self.config.vocab_size])
        return logits
