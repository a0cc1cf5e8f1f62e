"""`make verify-mlir`: the stitched MLIR-AIR modules, executed, against the simulated device.

For every group kind and every prefill bucket of a model (the tiny one by default), plus
attention after cached positions (tile-aligned, unaligned, and a chat turn's few rows), the
resident-KV designs (the fused decode at positions around a chunk boundary, mid-cache and at
the cache's last position, and prefill attention appending to the resident cache at the same
offsets), the interpreter device runs the module the NPU would receive and the simulated
device runs the group's declaration, on the same inputs and on the NPU's numbers on every CPU
class (`SimDevice(npu_numerics=True)`); every output element is compared, and in the resident
designs every intermediate and every resident state buffer after the run too (random
contents before it, so a read or a write of the wrong positions shows). Then both generate greedily from one prompt.

Tolerance, per element: |interp - sim| <= 2^-6 * (|sim| + the largest |sim| in its row). Both
sides take bf16 inputs, accumulate in f32 and round to bf16 at the same launch boundaries,
but sum in different orders (core tiles and K steps against one native loop), so an
intermediate may round one ulp apart (at most 2^-7 of its value). A later launch that
combines two values of a row (RoPE's rotation, a norm, a GEMM) carries that at most twice,
2^-6 of the row's largest value, and the output's own rounding adds up to one ulp on each
side, 2^-6 of the output. The row term also covers outputs that cancel to near zero.

That bound admits an error of up to 2^-6 (1.6 %) on every element at once, which a wrong
constant makes (an RMSNorm dividing by 248 instead of 256, or with eps 1e-2). So each output
is also fitted as a whole (`systematic_error`): a scale or an offset that rounding noise could
not produce fails, down to 2^-10 (0.1 %).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernel_builder import groups
from kernel_builder.backend_presets import decode_attention_tiling
from kernel_builder.fused_groups import cache_capacity, fused_decode, resident_flash_attn, window_for

from llama_base.group_contract import FUSED_KIND, KernelGroup, Role
from llama_base.config import LlamaConfig
from llama_base.errors import UserError
from llama_runtime.checkpoints.resolve import TINY, ResolvedModel, resolve_checkpoint
from llama_runtime.cli.options import add_model_options
from llama_runtime.checkpoints.quantize import quantize
from llama_runtime.engine.weight_slots import static_tensors
from multi_launch_builder.compile import compile_group_mlir
from npu_runtime.api import Sync
from npu_runtime.interp.device import InterpDevice
from npu_runtime.sim.device import SimDevice

TOLERANCE = 2.0 ** -6
SYSTEMATIC_FLOOR = 2.0 ** -10     # a scale or offset this far from exact is never chance
SYSTEMATIC_SIGMAS = 6.0
# A quantized group's second row: the synthetic matrices of `inputs`, quantized. A trained
# model's weights (std about 0.02) leave an FFN branch small beside the residual it joins, so
# an error in the branch can hide under the tolerance there; scaled by 1/sqrt(K), each branch
# weighs as much as the residual (the mutants run on these for that reason).
SYNTHETIC = "(synthetic weights)"


# The context the resident-KV cases' cache is sized for (`cache_capacity`): small, so the
# interpreter runs the fused decode in about a second, and several windows apart.
FUSED_CONTEXT = 512


@dataclass
class Case:
    group: KernelGroup
    q_start: int = 0          # the i32 input of attention groups: where the query rows start
    #                           (the fused decode's `pos`: the token's position)


@dataclass
class Row:
    name: str
    max_abs_diff: float
    compared: int
    worst: float              # largest |diff| / allowed; <= 1 passes
    error: str = ""
    systematic: float = 0.0   # `systematic_error`; <= 1 passes

    @property
    def passed(self) -> bool:
        return not self.error and self.worst <= 1.0 and self.systematic <= 1.0


def cases(cfg: LlamaConfig, max_seq: int | None = None, quant: str = "bf16",
          wide_sets=(frozenset(),)) -> list[Case]:
    """Every group a session of `quant` weights compiles (with the variants of a model holding
    some of its layers' weights in bf16, `wide_sets`), and attention at offsets."""
    buckets = groups.prefill_buckets(cfg, max_seq)
    out = [Case(g) for g in groups.all_groups(cfg, buckets, quant, wide_sets)]
    seq = buckets[0]
    for start, n in attention_starts(seq):
        # A chunk of the smallest bucket after `start` cached positions, in the context a
        # session compiles for it: the query rows' positions move the mask and the K/V tiles.
        ctx = max(seq, groups.context_bucket(start + n, seq, buckets[-1]))
        if ctx <= buckets[-1]:
            out.append(Case(groups.build_group("flash_attn", cfg, seq, ctx), q_start=start))
    return out


def resident_capacity(cfg: LlamaConfig) -> int:
    return cache_capacity(cfg, min(FUSED_CONTEXT, cfg.max_position_embeddings), FUSED_CONTEXT)


def decode_positions(cfg: LlamaConfig, capacity: int) -> list[int]:
    """The fused decode's positions compared: the first, both sides of the first chunk boundary
    (the last position of chunk 0, the first of chunk 1 and the one after), an unaligned
    position mid-cache and the cache's last. A chunk count or a mask bound one off reads a
    position too many or too few at some of them."""
    chunk = decode_attention_tiling(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, capacity)["chunk"]
    return [0, chunk - 1, chunk, chunk + 1, capacity // 2 + chunk // 3, capacity - 1]


def resident_cases(cfg: LlamaConfig, max_seq: int | None = None, quant: str = "bf16",
                   wide_sets=(frozenset(),)) -> list[Case]:
    """The fused decode at `decode_positions`, each in the window a session runs it in, and once
    in the whole capacity's window (upstream's form, every chunk moved); in a quantized format
    (which changes only the weights' launches) one position per set of bf16-held weights. And
    prefill attention on the resident cache at `attention_starts`' offsets, a chunk of the
    smallest bucket."""
    seq = groups.prefill_buckets(cfg, max_seq)[0]
    capacity = resident_capacity(cfg)
    positions = decode_positions(cfg, capacity)
    out, seen = [], set()
    for wide in wide_sets:
        for pos in positions if quant == "bf16" else positions[4:5]:
            g = fused_decode(cfg, capacity, quant, [wide] * cfg.num_hidden_layers, window_for(pos + 1, capacity))
            if (g.name, pos) not in seen:
                seen.add((g.name, pos))
                out.append(Case(g, q_start=pos))
    if quant == "bf16":
        out.append(Case(fused_decode(cfg, capacity), q_start=positions[3]))
    for start, _ in attention_starts(seq):
        out.append(Case(resident_flash_attn(cfg, seq, capacity, window_for(start + seq, capacity)), q_start=start))
    return out


def attention_starts(seq: int) -> list[tuple[int, int]]:
    """(cached positions, new rows) of the attention chunks compared: one tile-aligned start
    past the first tile, starts inside a tile (1, odd, mid-tile), and a chat turn's shape, a few
    new rows after an odd number of cached ones (prefill at any start: chat continuation). A
    mask that used the key position where the query's belongs agrees at aligned starts only."""
    return [(seq, seq), (1, seq), (seq // 2 + 1, seq), (2 * seq + 5, 5)]


_MEMO = 8     # modules and input sets kept: the cases of one group (its positions, its starts) reuse them
_texts: OrderedDict = OrderedDict()
_random: OrderedDict = OrderedDict()


def _kept(memo: OrderedDict, key, make, size: int = _MEMO):
    if key not in memo:
        memo[key] = make()
        if len(memo) > size:
            memo.popitem(last=False)
    memo.move_to_end(key)
    return memo[key]


def module_text(group: KernelGroup) -> str:
    """`compile_group_mlir(group)`, kept for the group's other cases (a pure function of the
    declaration); keyed on the function too, so one replaced in this module compiles anew."""
    return _kept(_texts, (compile_group_mlir, group), lambda: compile_group_mlir(group))


def inputs(case: Case, seed: int = 0, weights=None) -> dict[str, torch.Tensor]:
    """Activations ~N(0,1); norm weights near 1; matrices scaled by 1/sqrt(K) so outputs stay ~1,
    quantized where the slot is (random bytes in a packed slot would be scales of every
    magnitude, NaN among them). Resident state (the KV cache) ~N(0,1) everywhere, as earlier
    tokens would have left it: a run that attends to a position past the token's, or
    appends at the wrong one, gives other numbers.

    With `weights` (a model's), the static slots are that model's layer 0 (or LM head) instead,
    quantized where the slot is: Q4NX groups run on the weights a session would upload."""
    group = case.group
    drawn = (_kept(_random, (group, seed), lambda: _drawn(group, seed, None)) if weights is None
             else _drawn(group, seed, weights))     # the same tensors for every case of a group: only the scalar moves
    scalars = {s.name: torch.full(s.shape, case.q_start, dtype=torch.int32) for s in group.slots if s.dtype == "i32"}
    return {**drawn, **scalars}


_quantizations: OrderedDict = OrderedDict()


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """`quantize(t)` of a model's weight, kept by its contents: the fused decode's layers and LM
    head are the per-layer groups' and the LM head group's tensors, quantized once (a second
    or so a matrix)."""
    key = (tuple(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
    return _kept(_quantizations, key, lambda: quantize(t), 64)


def _drawn(group: KernelGroup, seed: int, weights) -> dict[str, torch.Tensor]:
    """`inputs` but the i32 scalars."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    case = Case(group)
    if weights is not None and case.group.with_role(Role.STATIC):
        grp = case.group    # its bf16 twin names the bf16 tensors behind the slots
        if grp.kind == FUSED_KIND:
            twin = fused_decode(weights.config, grp.capacity, window=grp.ctx_len)
        else:
            twin = groups.build_group(grp.kind, weights.config, grp.seq_len, grp.ctx_len or None)
        real = static_tensors(twin, weights, 0)
        for s in grp.with_role(Role.STATIC):
            t = real[s.name]
            if s.quantized and t.shape[0] < s.shape[0]:     # Q4NX LM-head partitions are padded further
                t = torch.cat([t, t.new_zeros(s.shape[0] - t.shape[0], t.shape[1])])
            out[s.name] = _quantized(t) if s.quantized else t.to(s.torch_dtype)
    for s in case.group.slots:
        if s.role not in (Role.INPUT, Role.STATIC, Role.STATE) or s.name in out or s.dtype == "i32":
            continue
        if s.role is Role.STATIC and len(s.shape) == 1:
            out[s.name] = (1 + 0.1 * torch.randn(s.shape, generator=g)).to(s.torch_dtype)
        elif s.role is Role.STATIC:
            w = torch.randn(s.shape, generator=g) / s.shape[-1] ** 0.5
            out[s.name] = quantize(w.bfloat16()) if s.quantized else w.to(s.torch_dtype)
        else:
            out[s.name] = torch.randn(s.shape, generator=g).to(s.torch_dtype)
    return out


def run_group(device, group: KernelGroup, mlir_text: str, data: dict[str, torch.Tensor],
              roles: tuple[Role, ...] = (Role.OUTPUT,)) -> dict[str, np.ndarray]:
    """One run of `group` on `device` through the device API: the slots of `roles` (its outputs,
    and its intermediates when asked for) as f32 arrays."""
    with tempfile.TemporaryDirectory() as tmp:
        device.compile(group, Path(tmp), mlir_text)
        kernel = device.load(Path(tmp), group)
    bos = [device.bo(s.nbytes, kernel, i) for i, s in enumerate(group.slots)]
    for s, bo in zip(group.slots, bos):
        if s.name in data:
            bo.write(data[s.name])
            bo.sync(Sync.TO_DEVICE)
    kernel.run(bos)
    out = {}
    for s, bo in zip(group.slots, bos):
        if s.role in roles:
            bo.sync(Sync.FROM_DEVICE)
            out[s.name] = bo.read(s.nbytes).view(s.torch_dtype).float().numpy().reshape(s.shape)
    return out


def compare(case: Case, label: str | None = None, weights=None, text: str | None = None) -> Row:
    """`text` runs another module for the group (a mutant) in place of the one its builders make."""
    name = label or (case.group.name + (f"@{case.q_start}" if case.q_start else ""))
    text = text or module_text(case.group)
    data = inputs(case, weights=weights)
    # A resident design's intermediates are compared too: its decode attention's partial sums
    # and stats are the contract of what each split computes (a split past the live chunks
    # holds the fill, 0 and zeros), which the merged rows alone would not show.
    roles = (Role.OUTPUT, Role.STATE, Role.INTERMEDIATE) if case.group.with_role(Role.STATE) else (Role.OUTPUT,)
    ref = run_group(SimDevice(npu_numerics=True), case.group, text, data, roles)
    try:
        got = run_group(InterpDevice(), case.group, text, data, roles)
    except Exception as e:      # an interpreter check or an unimplemented op: the row says which
        return Row(name, float("nan"), 0, float("inf"), str(e))
    worst, max_diff, n, systematic = 0.0, 0.0, 0, 0.0
    for k, r in ref.items():
        d = np.abs(got[k] - r)
        row_max = np.abs(r).max(axis=-1, keepdims=True) if r.size else r
        allowed = TOLERANCE * (np.abs(r) + row_max)
        finite = d[~np.isnan(d)]      # a NaN is over any tolerance (below); the largest number is reported
        max_diff = max(max_diff, float(finite.max()) if finite.size else 0.0 if not d.size else float("nan"))
        with np.errstate(over="ignore"):     # a quotient past f32's range is over any tolerance: inf
            ratio = np.where(np.isfinite(d), d / np.maximum(allowed, np.finfo(np.float32).tiny), np.inf)
        worst = max(worst, float(ratio.max()) if ratio.size else 0.0)
        systematic = max(systematic, systematic_error(r, got[k]))
        n += d.size
    return Row(name, max_diff, n, worst, systematic=systematic)


def systematic_error(ref: np.ndarray, got: np.ndarray) -> float:
    """How far `got` is from `ref` as a whole, in units of what chance allows: the larger of a
    fitted scale's and a fitted offset's distance from exact, each over its limit; <= 1 passes.

    Both devices round each output to bf16 nearest-even and differ only in the f32 order of
    their sums, so a difference of a few ulps on an element is as often up as down: fitted over
    all elements, the scale of got against ref has no reason to leave 1 and an offset none to
    leave 0. The limit of each is the larger of `SYSTEMATIC_FLOOR` and `SYSTEMATIC_SIGMAS`
    standard errors of the fit (from the residuals themselves), so a slope that chance could
    produce on a small output never fails, and one that chance could not, above the floor, does."""
    r = ref.astype(np.float64).reshape(-1)
    g = got.astype(np.float64).reshape(-1)
    if not r.size or not np.isfinite(g).all():
        return 0.0 if not r.size else float("inf")
    rr = float((r * r).sum())
    if rr == 0.0:
        return 0.0
    scale = float((g * r).sum()) / rr                       # least squares g ~ scale * r
    resid = g - scale * r
    se_scale = float(np.sqrt((resid * resid * r * r).sum())) / rr
    rms = np.sqrt(rr / r.size)
    offset = float((g - r).mean()) / rms                    # mean difference, in units of the typical |ref|
    se_offset = float((g - r).std()) / rms / np.sqrt(r.size)
    return max(abs(scale - 1) / max(SYSTEMATIC_FLOOR, SYSTEMATIC_SIGMAS * se_scale),
               abs(offset) / max(SYSTEMATIC_FLOOR, SYSTEMATIC_SIGMAS * se_offset))


def generation(model: str | ResolvedModel, n_tokens: int, prompt: str, quant: str = "bf16",
               decode: str = "auto") -> tuple[bool, str]:
    """Greedy tokens on both devices, the simulated one on the NPU's numbers as in `compare`.
    Where they part, both devices score the shared prefix again: it passes if the two
    candidates are within the tolerance of each other on both sides (a near-tie that rounding
    may flip) and each is in the other side's top 5. `decode` "fused" runs both
    sessions' decode as the fused group (the KV cache resident, prefill's attention appending
    to it), executed as MLIR on the interpreter."""
    from llama32_1b_inference import build_session   # verify sits above the entry points
    from llama32_1b_prefill import prefill

    devices = {"sim": SimDevice(npu_numerics=True), "interp": "interp"}
    print(f"[device] {devices['sim'].name}", flush=True)     # the interpreter's opener says its own
    sessions = {d: build_session(model, dev, log=lambda *_: None, quant=quant, decode=decode)
                for d, dev in devices.items()}
    ids = sessions["sim"].encode(prompt)
    a, b = (sessions[d].generate(ids, n_tokens).tokens for d in ("sim", "interp"))
    if a == b:
        return True, f"{len(a)} greedy tokens identical"
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return False, f"one side stopped early: sim {len(a)} tokens, interp {len(b)}"
    ok, notes = True, []
    for d, other in (("sim", b[i]), ("interp", a[i])):
        logits = prefill(sessions[d].model, ids + a[:i], start=0).float()
        own = int(torch.argmax(logits))
        gap = float(logits[own] - logits[other])
        allowed = 2 * TOLERANCE * float(logits[own].abs() + logits.abs().max())
        top5 = torch.topk(logits, 5).indices.tolist()
        ok = ok and gap <= allowed and other in top5
        notes.append(f"{d}: {own} leads {other} by {gap:.4g} (near-tie bound {allowed:.4g}, "
                     f"{'in' if other in top5 else 'NOT in'} top 5)")
    return ok, f"tokens part at step {i} of {len(a)}; " + "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify.mlir", description=__doc__.splitlines()[0])
    add_model_options(ap, model=TINY, model_help="model whose shapes (config.json) the groups take",
                      quant_help="weight format of the groups; quantized groups run on the model's own weights, "
                                 "quantized, and on synthetic ones, and generation runs on sessions of that format",
                      decode=True, without=("device",))   # the interpreter against the simulated device, always
    ap.add_argument("--max-seq", type=int, help="largest prefill bucket (default: the model's context)")
    ap.add_argument("--n-tokens", type=int, default=16, help="greedy tokens compared end to end (0: skip)")
    ap.add_argument("--prompt", default="What is the capital of Japan?")
    args = ap.parse_args(argv)
    try:
        resolved = resolve_checkpoint(args.model, quant=args.quant)
        cfg = resolved.config
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weights, wide = None, (frozenset(),)
    if args.quant != "bf16":
        from llama32_1b_weights import load_weights   # verify sits above the entry points
        from llama_runtime.checkpoints.q4nx_weights import wide_sets

        weights, wide = load_weights(resolved), wide_sets(resolved.gguf, cfg)
    rows = []
    for c in cases(cfg, args.max_seq, args.quant, wide) + resident_cases(cfg, args.max_seq, args.quant, wide):
        rows.append(compare(c, weights=weights))
        # The synthetic row is for the per-layer groups' FFN branches; the fused decode's
        # layers are those modules, run on the model's weights here.
        if weights is not None and c.group.quantized and c.group.kind != FUSED_KIND:
            rows.append(compare(c, label=f"{c.group.name} {SYNTHETIC}"))
    width = max(len(r.name) for r in rows)
    print(f"{'group':{width}}  {'max|diff|':>10}  {'elements':>9}  {'of allowed':>10}  {'systematic':>10}  result")
    for r in rows:
        result = "ok" if r.passed else f"FAIL {r.error}" if r.error else "FAIL"
        print(f"{r.name:{width}}  {r.max_abs_diff:10.4g}  {r.compared:9d}  {r.worst:10.3f}  {r.systematic:10.3f}  {result}")
    ok = all(r.passed for r in rows)
    if args.n_tokens:
        gen_ok, text = generation(resolved, args.n_tokens, args.prompt, args.quant, args.decode)
        print(f"[verify-mlir] generation: {text}")
        ok = ok and gen_ok
    print(f"[verify-mlir] {'PASS' if ok else 'FAIL'} (tolerance {TOLERANCE:g} x (|sim| + row max |sim|) per element; "
          f"fitted scale and offset within max({SYSTEMATIC_FLOOR:g}, {SYSTEMATIC_SIGMAS:g} standard errors))")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
