"""`make mutants`: mutate the tiny model's stitched modules and put every mutant through the
checks `make verify-mlir` relies on.

`--quant q4nx` mutates the groups that format changes (the GEMMs and GEMVs on packed weights,
with the launches around them), on the same synthetic inputs, their matrices quantized. Not on
the tiny model's own weights, as `make verify-mlir QUANT=q4nx` runs: their scale (std 0.02)
leaves an FFN branch small beside the residual it is added to, and a mutant that drops half of
a down projection's sum then hides under the tolerance.

A mutant first has to be well-formed MLIR (IREE's parser and verifier, as the validator parses):
one that is not is discarded and counted apart, never as killed. Then, in order: the validator
and its cross-check against the group declaration, and the interpreter run compared with the
simulated device (`verify.mlir.compare`, the same tolerance). The first check that fails kills
the mutant. A mutant an equivalence rule covers must survive (else the rule is wrong); any other
survivor fails the suite unless `expected.SURVIVORS` lists it with the reason it gets through.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from iree.compiler import ir

from kernel_builder import groups
from kernel_builder.fused_groups import fused_decode

from llama_base import group_contract

from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.resolve import TINY, resolve_checkpoint
from llama_runtime.cli.options import add_model_options
from multi_launch_builder.compile import compile_group_mlir
from multi_launch_builder.mlir_validate import rewrite_calls, validate_group_module
from npu_runtime.api import Sync
from npu_runtime.interp.device import InterpDevice
from npu_runtime.interp.machine import L1
from verify import mlir as verify_mlir
from verify.mutants.expected import SURVIVORS
from verify.mutants.operators import Mutant, mutants


@dataclass
class Outcome:
    group: str
    mutant: Mutant
    stage: str          # malformed | validator | interpreter | comparison | survived
    detail: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.mutant.operator, self.mutant.site)

    @property
    def killed(self) -> bool:
        return self.stage in ("validator", "interpreter", "comparison")

    @property
    def verdict(self) -> str:
        if self.stage == "malformed":
            return "malformed"
        if self.mutant.equivalent:
            # the validator may still refuse it: it checks the module against the declaration
            return "RULE BROKEN" if self.stage in ("interpreter", "comparison") else "equivalent"
        if self.killed:
            return "killed"
        return "expected survivor" if self.key in SURVIVORS else "SURVIVED"


def suite_cases(cfg: LlamaConfig, quant: str = "bf16", resident: bool = True) -> list[verify_mlir.Case]:
    """One group of each kind at the smallest bucket, attention at an offset (masking and the K/V
    tile range both move there), and the decode groups; with `resident`, the resident-KV
    designs at verify-mlir's positions and offsets (`verify_mlir.resident_cases`: a mistake
    in the live length shows at some only). In a quantized format, only the groups it
    changes: the others are the bf16 suite's modules, byte for byte."""
    smallest = groups.prefill_buckets(cfg)[0]
    picked = []
    if resident and quant == "bf16":
        # The fused decode in its whole capacity's window at every position verify-mlir runs,
        # so one module meets them all; prefill attention on the resident cache at its offsets.
        capacity = verify_mlir.resident_capacity(cfg)
        fused = fused_decode(cfg, capacity)
        picked += [verify_mlir.Case(fused, pos) for pos in verify_mlir.decode_positions(cfg, capacity)]
        picked += [c for c in verify_mlir.resident_cases(cfg) if c.group.kind != group_contract.FUSED_KIND]
    for c in verify_mlir.cases(cfg, quant=quant):
        g = c.group
        if quant != "bf16" and not g.quantized:
            continue
        if g.kind == "flash_attn" and not c.q_start:
            continue
        if g.kind in group_contract.PREFILL_KINDS and g.seq_len != smallest:
            continue
        picked.append(c)
    return picked


# The launches of the fused decode that are its own: every other launch of it is a per-layer
# decode group's module, mutated there. Its first layer's stand for the rest.
FUSED_OWN_OPS = ("kv_append", "decode_attn", "attn_merge")


def own_sites(group, ms: list[Mutant]) -> list[Mutant]:
    """The mutants of a fused decode's own launches in its first layer (all of another group's)."""
    if group.kind != group_contract.FUSED_KIND:
        return ms
    own = {l.name for l in group.launches if l.op in FUSED_OWN_OPS and group_contract.split_layer_slot(l.name)[0] == 0}
    return [m for m in ms if m.site.split(":")[0] in own]


def idle_cores(case: verify_mlir.Case, text: str) -> set[tuple[str, int, int]]:
    """(herd, x, y) of every core that writes nothing outside its own L1 in a run of `text`:
    the run records, per core, every buffer the interpreter marks written."""
    device = InterpDevice()
    with tempfile.TemporaryDirectory() as tmp:
        device.compile(case.group, Path(tmp), text)
        kernel = device.load(Path(tmp), case.group)
    machine = kernel.machine
    mark = machine._mark_written
    seen: set[tuple[str, str]] = set()
    busy: set[tuple[str, str]] = set()

    def recording_mark(buf, idx):
        core = (machine.where["herd"], machine.where["core"])
        if core[1] != "-":
            seen.add(core)
            if buf.space != L1:
                busy.add(core)
        return mark(buf, idx)

    machine._mark_written = recording_mark
    data = verify_mlir.inputs(case)
    bos = [device.bo(s.nbytes, kernel, i) for i, s in enumerate(case.group.slots)]
    for s, bo in zip(case.group.slots, bos):
        if s.name in data:
            bo.write(data[s.name])
            bo.sync(Sync.TO_DEVICE)
    kernel.run(bos)
    out = set()
    for herd, core in seen - busy:
        x, y = (int(v) for v in core.strip("()").split(","))
        out.add((herd, x, y))
    return out


def well_formed(text: str) -> str:
    """'' if IREE parses and verifies the module (calls rewritten as for validation), else why not."""
    try:
        with ir.Context() as ctx:
            ctx.allow_unregistered_dialects = True
            ir.Module.parse(rewrite_calls(text))
    except ir.MLIRError as e:
        return str(e).splitlines()[0]
    return ""


def check(case: verify_mlir.Case, mutant: Mutant) -> Outcome:
    name = case.group.name
    why = well_formed(mutant.text)
    if why:
        return Outcome(name, mutant, "malformed", why)
    try:
        validate_group_module(mutant.text, case.group)
    except ValueError as e:
        return Outcome(name, mutant, "validator", str(e).splitlines()[0][:160])
    row = verify_mlir.compare(case, text=mutant.text)
    if row.error:
        return Outcome(name, mutant, "interpreter", row.error.splitlines()[0][:160])
    if not row.passed:
        return Outcome(name, mutant, "comparison", f"{row.worst:.3g} x the tolerance")
    return Outcome(name, mutant, "survived", f"{row.worst:.3g} x the tolerance")


def check_all(cases: list[verify_mlir.Case], mutant: Mutant) -> Outcome:
    """A mutant of a module is killed when any case that runs the module kills it: attention's
    module runs at several query starts, and a mask or tile-range error shows at some only."""
    outcome = check(cases[0], mutant)
    for case in cases[1:]:
        if outcome.stage != "survived":
            break
        outcome = check(case, mutant)
    return outcome


def sample(ms: list[Mutant], per_operator: int | None, seed: int) -> list[Mutant]:
    """Up to `per_operator` mutants of each operator (all with None), the same ones for a seed."""
    if per_operator is None:
        return ms
    rng = random.Random(seed)
    by_op: dict[str, list[Mutant]] = {}
    for m in ms:
        by_op.setdefault(m.operator, []).append(m)
    out = []
    for op in sorted(by_op):
        group = by_op[op]
        out.extend(group if len(group) <= per_operator else rng.sample(group, per_operator))
    return out


def run(cfg: LlamaConfig, per_operator: int | None, seed: int = 0, kinds: tuple[str, ...] | None = None,
        log=print, quant: str = "bf16", resident: bool = True) -> list[Outcome]:
    outcomes = []
    by_module: dict[str, list[verify_mlir.Case]] = {}
    for case in suite_cases(cfg, quant, resident):
        if not kinds or case.group.kind in kinds:
            by_module.setdefault(case.group.name, []).append(case)
    for name, cases in by_module.items():
        text = compile_group_mlir(cases[0].group)
        chosen = sample(own_sites(cases[0].group, mutants(text, cases[0].group, idle_cores(cases[0], text))),
                        per_operator, seed)
        for m in chosen:
            outcomes.append(check_all(cases, m))
        log(f"[mutants] {name} ({len(cases)} case{'s' * (len(cases) > 1)}): {len(chosen)} mutants, "
            + ", ".join(f"{v} {k}" for k, v in sorted(Counter(o.verdict for o in outcomes[-len(chosen):]).items())))
    return outcomes


def summary(outcomes: list[Outcome]) -> tuple[str, bool]:
    verdicts = Counter(o.verdict for o in outcomes)
    killed = verdicts["killed"]
    live = verdicts["SURVIVED"] + verdicts["expected survivor"]
    rate = killed / max(killed + live, 1)
    lines = [f"{len(outcomes)} mutants: {killed} killed, {verdicts['equivalent']} equivalent (by rule), "
             f"{verdicts['expected survivor']} expected survivors, {verdicts['SURVIVED']} unexpected survivors, "
             f"{verdicts['RULE BROKEN']} broken equivalence rules, {verdicts['malformed']} malformed (discarded)",
             f"kill rate {rate:.1%} of the {killed + live} non-equivalent well-formed mutants",
             "killed by: " + ", ".join(f"{k} {v}" for k, v in sorted(Counter(o.stage for o in outcomes if o.killed).items()))]
    for o in outcomes:
        if o.verdict in ("SURVIVED", "RULE BROKEN", "expected survivor"):
            reason = SURVIVORS.get(o.key, o.mutant.equivalent)
            lines.append(f"  {o.verdict}: {o.group} {o.mutant.operator} {o.mutant.site} ({o.detail})"
                         + (f": {reason}" if reason else ""))
    for o in outcomes:
        if o.key in SURVIVORS and o.verdict == "killed":
            lines.append(f"  stale expected survivor (now killed by {o.stage}; drop it from expected.py): "
                         f"{o.group} {o.mutant.operator} {o.mutant.site}")
    ok = verdicts["SURVIVED"] == 0 and verdicts["RULE BROKEN"] == 0
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify.mutants", description=__doc__.splitlines()[0])
    add_model_options(ap, model=TINY, model_help="model whose shapes (config.json) the groups take",
                      quant_help="weight format of the groups mutated (a quantized one: only the groups it changes)",
                      without=("device",))        # mutants run on the interpreter and the simulated device
    ap.add_argument("--per-operator", type=int, default=12,
                    help="mutants of each operator per group (0: every site)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = resolve_checkpoint(args.model).config
    outcomes = run(cfg, args.per_operator or None, args.seed, quant=args.quant)
    text, ok = summary(outcomes)
    print(text)
    print(f"[mutants] {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
