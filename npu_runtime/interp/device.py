"""The interpreter device: runs the stitched MLIR-AIR module itself, behind the device API.

Its artifact is the module the NPU build would compile (`group.mlir`); loading parses it and
binds its external kernels to host builds of the same C++ sources (`npu_runtime.interp.host_kernels`).
Buffers behave as on the simulated device (host and device copies apart until synced, so the
BO contract is checked the same way), but weights are never packed: the module reads them in
the layout the NPU would.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from iree.compiler import ir

from kernel_builder.externs import externs_for_launch
from llama_base.group_contract import KernelGroup, Role
from llama_base.paths import host_kernels_dir
from npu_runtime.api import Counters, DeviceError
from npu_runtime.interp.host_kernels import HostKernels
from npu_runtime.interp.machine import DTYPES, ExternCall, Machine
from npu_runtime.interp.program import CALL_OP, Block, Op, load_program
from npu_runtime.sim.device import SimBO, SimSubBO


def _check_links(group: str, block: Block, kernels: dict, herd: Op | None = None) -> None:
    """Every herd names, in `link_with`, the object that defines each kernel it calls (the
    extern contract's `link_object`): the host builds would run a call that the NPU's link
    could not resolve, so the module is refused here as the validator refuses it."""
    for op in block.ops:
        if op.name == CALL_OP and herd is not None:
            callee, link = op.attrs["callee"], herd.attrs.get("link_with")
            want = kernels[callee].link_object if callee in kernels else None
            if want is not None and link != want:
                raise DeviceError(f"{group}: herd {herd.attrs.get('sym_name', '?')} calls @{callee}, defined in "
                                  f"{want!r}, but links {repr(link) if link else 'no object'}")
        for region in op.regions:
            _check_links(group, region, kernels, op if op.name == "air.herd" else herd)


class InterpKernel:
    def __init__(self, device: "InterpDevice", artifact_dir: Path, group: KernelGroup):
        self.device = device
        self.group = group
        try:
            program = load_program((artifact_dir / "group.mlir").read_text())
        except (OSError, ValueError, ir.MLIRError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DeviceError(f"{artifact_dir}: cannot load {group.name}'s module ({first})") from None
        kernels = {k.symbol: k for launch in group.launches for k in externs_for_launch(launch)}
        missing = sorted(set(program.externs) - set(kernels))
        if missing:
            raise DeviceError(f"{group.name}: the module declares {missing}, which no launch of the group calls")
        _check_links(group.name, program.body, kernels)
        host = HostKernels(kernels.values(), host_kernels_dir()) if kernels else None
        calls = {s: ExternCall(lambda *a, _s=s: host(_s, *a), k.reads, k.writes) for s, k in kernels.items()}
        index = {s.name: i for i, s in enumerate(group.slots)}
        self.machine = Machine(program, group.name, calls,
                               launch_writes=[tuple(index[w] for w in l.writes) for l in group.launches],
                               arg_names=[s.name for s in group.slots],
                               partial_writes=frozenset(i for i, s in enumerate(group.slots) if s.role is Role.STATE))
        self._written = {w for launch in group.launches for w in launch.writes}
        # A module compiled for another declaration would run on the wrong buffers.
        want = [(s.storage_shape, s.element_type) for s in group.slots]
        have = [(t.shape, t.dtype) for t in program.arg_types]
        if want != have:
            raise DeviceError(f"{artifact_dir}: module arguments do not match the declaration of {group.name}")

    def run(self, bos: list[SimBO]) -> None:
        if len(bos) != len(self.group.slots):
            raise DeviceError(f"{self.group.name}: {len(bos)} buffers for {len(self.group.slots)} arguments")
        arrays = []
        for slot, bo in zip(self.group.slots, bos):
            if bo.size < slot.nbytes:
                raise DeviceError(f"{self.group.name}: buffer for {slot.name} has {bo.size} bytes, needs {slot.nbytes}")
            raw = bo.device_view(for_write=slot.name in self._written)[: slot.nbytes]
            arrays.append(raw.numpy().view(np.uint8).view(DTYPES[slot.element_type]))
        self.machine.run(arrays)
        self.device.counters.runs += 1


class InterpDevice:
    """Executes group modules on the CPU; slow, and meant for small shapes and checking."""

    kind = "interp"
    key_on_module_text = True     # the artifact is the module: a changed text is a new entry
    name = "MLIR-AIR interpreter (stitched modules, host builds of the C++ kernels)"
    rebuild_on_load_error = True

    def __init__(self):
        self.counters = Counters()
        self.storage_epoch = 0     # kept by the simulated device's BOs, which this device's are

    def toolchain_stamp(self) -> str:
        return "interp-v1"

    def toolchain_description(self) -> str:
        return self.toolchain_stamp()

    def bo(self, nbytes: int, kernel: InterpKernel | None = None, arg: int | None = None) -> SimBO:
        self.counters.bos_allocated += 1
        self.counters.bytes_allocated += nbytes
        return SimBO(self, nbytes)

    def sub_bo(self, parent: SimBO, nbytes: int, offset: int = 0) -> SimSubBO:
        return SimSubBO(parent, nbytes, offset)

    def compile(self, group: KernelGroup, out_dir: Path, mlir_text: str) -> list[str]:
        (out_dir / "group.mlir").write_text(mlir_text)
        return ["group.mlir"]

    def load(self, artifact_dir: Path, group: KernelGroup) -> InterpKernel:
        return InterpKernel(self, artifact_dir, group)

    def recorder(self) -> None:
        """None: a run interprets the module, op by op; there is no native call to record."""
        return None

