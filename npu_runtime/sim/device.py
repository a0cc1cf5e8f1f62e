"""The simulated NPU: the device API (`npu_runtime.api`) on the CPU.

It keeps a BO's host and device copies apart, exactly as a missing cache flush would on
hardware: a host write is invisible to a kernel until `sync(TO_DEVICE)` and a kernel's result
is invisible to the host until `sync(FROM_DEVICE)`. To keep large weights resident once, a BO
that was written through `write()` (never mapped) shares one storage between its host and
device sides after a full sync until either side is written again (copy-on-write); the
visible semantics are unchanged. A weight BO allocated for a GEMM or GEMV argument is held on
the device side in packed tiles (`weight_tiles`) and its host side is dropped while equal, so
that weight is still resident once, in 3/4 of its bf16 bytes.
"""
from __future__ import annotations

import json
import mmap
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch

from cpu_kernels import native_cpu
from cpu_kernels.native_program import NativeProgram, ReplayError
from cpu_kernels.weight_tiles import DeviceQ4nx, PackedWeight, Packing, Q4nxPacking
from llama_base.group_contract import KernelGroup
from npu_runtime.api import Counters, DeviceError, RecordedInput, RecordedOutput, Sync, copy_bytes
from npu_runtime.sim import ops
from npu_runtime.sim.packing import packing_for

_VIEW_SETS = 256   # cached BO-list bindings per loaded group (one per layer in practice)
_HUGE = 2 << 20    # buffers from this size up ask for transparent huge pages


def _span(t: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """Bytes [offset, offset + n) of a buffer; the buffer itself when that is all of it (a decode
    row's sync is then one copy, not two slices and a copy)."""
    return t if offset == 0 and n == t.numel() else t[offset:offset + n]


def zeroed_buffer(nbytes: int) -> torch.Tensor:
    """Zeroed host memory; large buffers on huge pages.

    Decode streams every weight once per token: with 4 KiB pages that is a TLB miss per page,
    and huge pages measurably raise the rate at which the GEMVs read. Anonymous mappings are
    zero-filled by the kernel, as a fresh BO must read.
    """
    if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(m, dtype=torch.uint8)
    return torch.zeros(nbytes, dtype=torch.uint8)


class SimBO:
    """A simulated buffer object: host and device byte arrays, moved only by `sync`.

    Both sides are allocated on first use (a fresh BO reads as zeros, as XRT's do), so a
    weight buffer costs one copy of the weight: written on the host, then shared with the
    device side by a full sync until either side is written again. With a `packing`, the device
    side holds the packed form, and "shared" means the host side is dropped and rebuilt from it
    when the host next needs it. A write of a whole packed BO packs straight from the caller's
    tensor into a staged device form that the next sync installs: preload then reads each
    checkpoint weight once, instead of copying 2.5 GB into host buffers only to pack them.
    """

    def __init__(self, device: "SimDevice", nbytes: int, packing: Packing | Q4nxPacking | None = None):
        self.size = nbytes
        self.packing = packing
        self._device = device
        self._dev_counters = device.counters
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._shared = False       # the host side equals the device side (one storage, or derived)
        self._mapped = False       # a mapped BO may be written behind our back: never shared
        self._staged: torch.Tensor | None = None   # packed host contents a whole write left, not yet synced

    def _zeros(self) -> torch.Tensor:
        return zeroed_buffer(self.size)

    def _dev_side(self) -> torch.Tensor:
        if self._dev is None:
            self._set_dev(self.packing.pack(self._zeros(), zeroed_buffer) if self.packing else self._zeros())
        return self._dev

    def _set_dev(self, t: torch.Tensor) -> None:
        """Every change of the device storage passes here: bound launch programs hold views of it
        (`SimKernel._program`), and the device's epoch tells them to look again."""
        self._dev = t
        self._device.storage_epoch += 1

    def _host_form(self) -> torch.Tensor:
        """The device contents as the host lays them out (a copy when packed, else the storage)."""
        dev = self._dev_side()
        return self.packing.unpack(dev, self._zeros()) if self.packing else dev

    def _split(self) -> None:
        """End sharing: the host side gets its own copy of the (equal) contents."""
        host = self._host_form()
        self._host, self._shared = (host if self.packing else self._zeros().copy_(host)), False

    def _own_host(self) -> torch.Tensor:
        if self._staged is not None:       # the host side is needed after all: unpack the write
            self._host, self._staged = self.packing.unpack(self._staged, self._zeros()), None
        elif self._shared:
            self._split()
        elif self._host is None:
            self._host = self._zeros()
        return self._host

    def map(self) -> torch.Tensor:
        """The host memory as a writable uint8 tensor (like pyxrt's `bo.map()`)."""
        self._mapped = True
        return self._own_host()

    def write(self, data: torch.Tensor, offset: int = 0) -> None:
        raw = data.contiguous().view(torch.uint8).reshape(-1)
        if self.packing and not self._mapped and offset == 0 and raw.numel() == self.size:
            self._staged, self._host, self._shared = self.packing.pack(raw, zeroed_buffer), None, False
            return
        self._own_host()[offset:offset + raw.numel()].copy_(raw)

    def read(self, nbytes: int | None = None, offset: int = 0) -> torch.Tensor:
        end = self.size if nbytes is None else offset + nbytes
        return self._own_host()[offset:end].clone()

    def sync(self, direction: Sync, nbytes: int | None = None, offset: int = 0) -> None:
        n = self.size - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.size:
            raise DeviceError(f"a sync of bytes {offset}..{offset + n} is outside a {self.size}-byte buffer")
        if direction is Sync.TO_DEVICE:
            self._dev_counters.bytes_to_device += n
            if self._shared:
                return
            if self._staged is not None and offset == 0 and n == self.size:
                self._set_dev(self._staged)
                self._staged, self._shared = None, True
                return
            host = self._own_host()
            whole = not self._mapped and offset == 0 and n == self.size
            if self.packing:
                if whole:      # packed, the host side is dropped; rebuilt from the device when needed
                    self._set_dev(self.packing.pack(host, zeroed_buffer))
                    self._host, self._shared = None, True
                else:          # a range's values are scattered: merge it into the contents, repack
                    merged = self._host_form()
                    _span(merged, offset, n).copy_(_span(host, offset, n))
                    self._set_dev(self.packing.pack(merged, zeroed_buffer))
            elif whole:
                self._set_dev(host)       # one storage until either side writes
                self._shared = True
            else:
                copy_bytes(self._dev_side(), host, offset, n)
        else:
            self._dev_counters.bytes_from_device += n
            if not self._shared:
                copy_bytes(self._own_host(), self._host_form(), offset, n)

    def device_view(self, for_write: bool) -> torch.Tensor:
        """What a simulated kernel sees; a kernel write first gives the host side its own copy."""
        if for_write and self.packing:
            raise DeviceError("a kernel may not write a packed weight buffer")
        dev = self._dev_side()
        if for_write and self._shared:
            self._split()
        return dev

    def device_ptr(self) -> int:
        """Where the device side starts (a kernel binds its launch plan to these addresses)."""
        return self._dev_side().data_ptr()

    def host_ptr(self) -> int | None:
        """Where the mapped host side starts, for a recorded run (`SimKernel.record`); None for
        a packed weight, whose host side comes and goes. A mapped BO keeps both sides' storage
        for its life: it is never shared, and only a packing replaces them."""
        return None if self.packing else self.map().data_ptr()


class SimSubBO:
    """Bytes [offset, offset + size) of a parent BO as a BO of its own, as XRT's sub-buffers are:
    its host and device sides are that range of the parent's, its syncs move that range of the
    parent, and a kernel sees exactly `size` bytes. Activation buffers only: a packed weight has
    no byte ranges to hand out."""

    packing = None

    def __init__(self, parent: SimBO, nbytes: int, offset: int = 0):
        if isinstance(parent, SimSubBO):
            parent, offset = parent.parent, parent.offset + offset
        if parent.packing is not None:
            raise DeviceError("a packed weight buffer has no sub-buffers")
        if nbytes <= 0 or offset < 0 or offset + nbytes > parent.size:
            raise DeviceError(f"a sub-buffer of {nbytes} bytes at {offset} does not fit a {parent.size}-byte buffer")
        self.parent, self.size, self.offset = parent, nbytes, offset

    def _range(self, nbytes: int | None, offset: int) -> tuple[int, int]:
        n = self.size - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.size:
            raise DeviceError(f"bytes {offset}..{offset + n} are outside a {self.size}-byte sub-buffer")
        return n, self.offset + offset

    def map(self) -> torch.Tensor:
        return self.parent.map()[self.offset:self.offset + self.size]

    def write(self, data: torch.Tensor, offset: int = 0) -> None:
        self._range(data.numel() * data.element_size(), offset)
        self.parent.write(data, self.offset + offset)

    def read(self, nbytes: int | None = None, offset: int = 0) -> torch.Tensor:
        n, at = self._range(nbytes, offset)
        return self.parent.read(n, at)

    def sync(self, direction: Sync, nbytes: int | None = None, offset: int = 0) -> None:
        n, at = self._range(nbytes, offset)
        self.parent.sync(direction, n, at)

    def device_view(self, for_write: bool) -> torch.Tensor:
        return self.parent.device_view(for_write)[self.offset:self.offset + self.size]

    def device_ptr(self) -> int:
        return self.parent.device_ptr() + self.offset

    def host_ptr(self) -> int:
        return self.parent.host_ptr() + self.offset


class SimKernel:
    """Runs a group's launches in order on the device side of its BOs with reference kernels.

    The launch plan is bound to each BO list once (`ops.bind`: pointers and sizes fixed),
    so a run replays it. A decode token makes 33 runs; re-deriving every launch's operands in
    each of them cost about as much time as the elementwise kernels themselves, and even
    asking every BO for its address again cost about 0.2 ms a token (`_program`).
    """

    def __init__(self, device: "SimDevice", group: KernelGroup):
        self.device = device
        self.group = group
        # Sessions take the host attention's numbers, the NPU's when asked (`ops.plan`).
        self._plan = ops.plan(group.launches, host_attention=not device.npu_numerics)
        self._bind_step = partial(ops.bind, npu_numerics=device.npu_numerics)
        self._written = {w for l in group.launches for w in l.writes}
        self.packings = [packing_for(group, i) for i in range(len(group.slots))]
        self._programs: OrderedDict[tuple, tuple] = OrderedDict()
        # id of a BO list -> (device storage epoch, the list's BOs, bound program)
        self._by_list: dict[int, tuple[int, list, tuple]] = {}

    def _program(self, bos: list[SimBO]) -> tuple:
        """The plan bound to this BO list, cached per list: a group runs on one BO set per layer.

        Keyed on storage addresses; a cached entry keeps its storages alive (through its views),
        so an address cannot be reused by another buffer while the entry exists. The same BOs
        with no device storage replaced since (the device's `storage_epoch`) have the same
        addresses, so a repeated list skips asking for them.
        """
        seen = self._by_list.get(id(bos))
        if seen is not None and seen[0] == self.device.storage_epoch and seen[1] == bos:
            return seen[2]
        key = tuple(b.device_ptr() for b in bos)
        program = self._programs.get(key)
        if program is None:
            if len(bos) != len(self.group.slots):
                raise DeviceError(f"{self.group.name}: {len(bos)} buffers for {len(self.group.slots)} arguments")
            views = {}
            for slot, bo, packing in zip(self.group.slots, bos, self.packings):
                if bo.size < slot.nbytes:
                    raise DeviceError(f"{self.group.name}: buffer for {slot.name} has {bo.size} bytes, "
                                      f"needs {slot.nbytes}")
                raw = bo.device_view(for_write=slot.name in self._written)
                if bo.packing is None:
                    views[slot.name] = raw[: slot.nbytes].view(slot.torch_dtype).view(slot.storage_shape)
                elif bo.packing == packing:
                    form = DeviceQ4nx if isinstance(packing, Q4nxPacking) else PackedWeight
                    views[slot.name] = form(raw, bo.packing.n, bo.packing.k)
                else:
                    raise DeviceError(f"{self.group.name}: buffer for {slot.name} holds a packed weight "
                                      f"this argument does not read")
            program = self._programs[key] = (views, tuple(self._bind_step(step, views) for step in self._plan))
            if len(self._programs) > _VIEW_SETS:
                self._programs.popitem(last=False)
        if len(self._by_list) >= _VIEW_SETS:
            self._by_list.clear()
        self._by_list[id(bos)] = (self.device.storage_epoch, list(bos), program[1])
        return program[1]

    def run(self, bos: list[SimBO]) -> None:
        for call in self._program(bos):
            call()
        self.device.counters.runs += 1

    def record(self, prog: NativeProgram, bos: list[SimBO], inputs: list[RecordedInput],
               outputs: list[RecordedOutput]) -> None:
        """`SimDevice.record` for this kernel: its ops labelled ("call", group kind, "write" |
        "run" | "read") and the run tallied as ("call", kind), as the profiler splits a call."""
        program, kind = self._program(bos), self.group.kind
        prog.label = ("call", kind, "write")
        for bo, n, src, step in inputs:
            host = self._host_ptr(bo)
            prog.copy(host, src, n, step)
            prog.copy(bo.device_ptr(), host, n)
        prog.label = ("call", kind, "run")
        for step, call in zip(self._plan, program):
            try:
                prog.bound(call)
            except ReplayError as e:
                group = step if isinstance(step, list) else getattr(step, "launches", [step])
                launches = ", ".join(f"{l.name} ({l.op})" for l in group)
                raise ReplayError(f"{self.group.name}, launch {launches}: {e}") from None
        prog.label = ("call", kind, "read")
        for bo, n in outputs:
            prog.copy(self._host_ptr(bo), bo.device_ptr(), n)
        prog.label = None
        prog.tally(("call", kind))
        prog.hold(program, list(bos))
        prog.count(self.device.counters, runs=1, bytes_to_device=sum(i.nbytes for i in inputs),
                   bytes_from_device=sum(o.nbytes for o in outputs))

    def _host_ptr(self, bo: SimBO | SimSubBO) -> int:
        host = bo.host_ptr()
        if host is None:
            raise DeviceError(f"{self.group.name}: a packed weight buffer is no run's input or output")
        return host


class SimDevice:
    """The simulated NPU2: CPU reference kernels, bf16 storage, f32 accumulation. Its own
    `api.Recorder` (`recorder`): its launches are native calls with fixed pointers, which a
    native program can make without the interpreter between them."""

    kind = "sim"
    rebuild_on_load_error = True
    key_on_module_text = False    # its artifacts follow from the declaration and the builders

    @property
    def name(self) -> str:
        """Says which CPU kernels run (`native_cpu.isa()`): the same model runs several times
        faster natively, so a report or a `[device]` line without it cannot be compared."""
        numbers = ", the NPU's numbers" if self.npu_numerics else ""
        return f"simulated NPU2 (CPU kernels: {native_cpu.isa()}{numbers})"

    def __init__(self, npu_numerics: bool = False):
        """`npu_numerics`: compute the NPU's numbers on every CPU class, where a class's own
        kernels take a cheaper contract (`ops.bind`); what `make verify-mlir` holds the
        interpreted MLIR to. Sessions keep the class's kernels, the faster ones."""
        self.npu_numerics = npu_numerics
        self.counters = Counters()
        # `api.Recorder`'s: bumped whenever a BO's device storage is replaced (`SimBO._set_dev`).
        self.storage_epoch = 0

    def toolchain_stamp(self) -> str:
        return f"sim-ops-v1/torch-{torch.__version__}"

    def toolchain_description(self) -> str:
        return self.toolchain_stamp()

    def bo(self, nbytes: int, kernel: SimKernel | None = None, arg: int | None = None) -> SimBO:
        """A BO, laid out on the device for `kernel`'s argument `arg` when given (as XRT allocates
        a BO in the memory group of a kernel argument)."""
        self.counters.bos_allocated += 1
        self.counters.bytes_allocated += nbytes
        packing = kernel.packings[arg] if kernel is not None else None
        if packing is not None and nbytes != packing.nbytes:
            packing = None
        return SimBO(self, nbytes, packing)

    def sub_bo(self, parent: SimBO, nbytes: int, offset: int = 0) -> SimSubBO:
        return SimSubBO(parent, nbytes, offset)

    def compile(self, group: KernelGroup, out_dir: Path, mlir_text: str) -> list[str]:
        """The simulated artifact is the launch program itself (plus the stitched MLIR, for study)."""
        (out_dir / "program.json").write_text(json.dumps(group.to_json(), sort_keys=True))
        (out_dir / "group.mlir").write_text(mlir_text)
        return ["program.json", "group.mlir"]

    def load(self, artifact_dir: Path, group: KernelGroup) -> SimKernel:
        """Execute what the artifact says, not what the caller hopes: the program must equal the group."""
        try:
            program = json.loads((artifact_dir / "program.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DeviceError(f"{artifact_dir}: unreadable launch program ({e})") from None
        if program != json.loads(json.dumps(group.to_json(), sort_keys=True)):
            raise DeviceError(f"{artifact_dir}: launch program does not match the declaration of {group.name}")
        return SimKernel(self, group)

    # ---- recording (`api.Recorder`) ---------------------------------------------------------
    def recorder(self) -> SimDevice | None:
        """This device, which records its runs where every launch binds a native call: with the
        native library loaded and the class's own numbers. The torch class binds torch bodies,
        and `npu_numerics` may (it picks the NPU's contract over a class's native kernel);
        their tokens run call by call."""
        return self if native_cpu.available() and not self.npu_numerics else None

    def program(self) -> NativeProgram:
        return NativeProgram.new()

    def record(self, prog: NativeProgram, kernel: SimKernel, bos: list[SimBO], inputs: list[RecordedInput],
               outputs: list[RecordedOutput]) -> None:
        if not isinstance(kernel, SimKernel) or kernel.device is not self:
            raise DeviceError(f"a run of {type(kernel).__name__} recorded on a simulated device that did not load it")
        kernel.record(prog, bos, inputs, outputs)
