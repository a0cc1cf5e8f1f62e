"""The device API the runtime is written against: what every device implements.

It is the subset of pyxrt the runtime uses: allocate a buffer object (BO) or a sub-buffer of
one, map it, sync it to / from the device, build and load a group's artifact and run its kernel
on a list of BOs. The
real NPU (`npu_runtime.xrt`) and the simulated one (`npu_runtime.sim`) implement it, so the
KernelCache, preload and the prefill / decode loops are one code path for both. It is kept this
narrow so that a device which executes the stitched MLIR-AIR itself needs nothing more.

One capability is optional, and declared: recording (`Recorder`). A device whose kernels run
as native calls on the host can append a run's copies and calls to a native program, which
replays a whole decode token in one call (`llama_runtime.engine.recording`). Every device
answers `Device.recorder()`: the simulated one with itself, the others with None, and their
tokens then run call by call.
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from llama_base.group_contract import KernelGroup

if TYPE_CHECKING:
    from cpu_kernels.native_program import NativeProgram

_MEMMOVE_MAX = 256 << 10   # copies up to this size go by memmove


class Sync(enum.Enum):
    TO_DEVICE = "to_device"
    FROM_DEVICE = "from_device"


@dataclass
class Counters:
    """Bytes moved by syncs and kernel runs: what tests assert the BO contract with."""

    bytes_to_device: int = 0
    bytes_from_device: int = 0
    runs: int = 0
    bos_allocated: int = 0
    bytes_allocated: int = 0

    def snapshot(self) -> "Counters":
        return Counters(**self.__dict__)

    def since(self, before: "Counters") -> "Counters":
        return Counters(**{k: getattr(self, k) - getattr(before, k) for k in self.__dict__})


class DeviceError(RuntimeError):
    """A device-level failure (load, run) described in one line."""


class BO(Protocol):
    """A buffer object: host memory the runtime writes and reads, moved only by `sync`."""

    size: int

    def map(self) -> torch.Tensor: ...
    def write(self, data: torch.Tensor, offset: int = 0) -> None: ...
    def read(self, nbytes: int | None = None, offset: int = 0) -> torch.Tensor: ...
    def sync(self, direction: Sync, nbytes: int | None = None, offset: int = 0) -> None: ...


class Kernel(Protocol):
    """A loaded group: one run executes every launch of the group on the BO list (one per slot)."""

    def run(self, bos: list) -> None: ...


class AddressedBO(BO, Protocol):
    """A BO of a device that records (`Recorder`): both its sides are host memory, at addresses
    that hold while the device's `storage_epoch` does; a recorded run copies between them."""

    def host_ptr(self) -> int | None:
        """Where the host side starts (it is mapped for good); None for a packed weight, whose
        host side comes and goes and which no run's inputs or outputs are."""
        ...

    def device_ptr(self) -> int:
        """Where the device side starts: what the kernels' bound calls read and write."""
        ...


class RecordedInput(NamedTuple):
    """An input slot of a recorded run: `nbytes` into `bo`, read from the host address `source`
    plus `step` bytes per position (a table row), synced to the device."""

    bo: AddressedBO
    nbytes: int
    source: int
    step: int


class RecordedOutput(NamedTuple):
    """An output slot of a recorded run: its first `nbytes`, synced back from the device."""

    bo: AddressedBO
    nbytes: int


class Recorder(Protocol):
    """Recording: the runs of a device's kernels appended to a native program, which then makes
    them with no Python between them (`cpu_kernels.native_program`). A program holds raw
    addresses: of each BO's host and device sides (`AddressedBO`), and of the storages the
    kernels' bound calls point into. `storage_epoch` changes whenever any of them may have been replaced (a
    BO given new device storage), and a program recorded under another epoch must not run."""

    storage_epoch: int

    def program(self) -> NativeProgram:
        """An empty program to record into."""
        ...

    def record(self, prog: NativeProgram, kernel: Kernel, bos: list[AddressedBO], inputs: list[RecordedInput],
               outputs: list[RecordedOutput]) -> None:
        """Append one run of `kernel` (loaded by this device) on `bos` to `prog`, as
        `KernelCache.load_and_run` makes it: each input copied into its BO's host side and
        synced, the kernel's launches, each output synced back; the device's counters counted
        on every replay as the run would count them. Raises (`native_program.ReplayError`,
        naming the launch and its function) where a launch has no call the program can make:
        a device that records binds every launch natively."""
        ...


class Device(Protocol):
    """Builds, loads and runs groups. `compile` returns the artifact's file names (the
    KernelCache hashes them into its manifest); `toolchain_stamp` is part of the cache key,
    `toolchain_description` only recorded in the manifest (what built an entry, down to paths
    and dates that must not re-key it). `rebuild_on_load_error` says whether an entry that
    fails to load is rebuilt (a damaged artifact) or the load error is the answer (a driver
    that refuses a valid artifact would refuse the rebuild too). `key_on_module_text` adds the
    stitched module's text to the cache key, for a device whose artifact is that text."""

    kind: str
    name: str
    counters: Counters
    rebuild_on_load_error: bool
    key_on_module_text: bool

    def toolchain_stamp(self) -> str: ...
    def toolchain_description(self) -> str: ...
    def bo(self, nbytes: int, kernel: Kernel | None = None, arg: int | None = None) -> BO: ...
    # Bytes [offset, offset + nbytes) of `parent` as a BO of its own (XRT's `xrt::bo(parent,
    # size, offset)`): its map is that range of the parent's, its syncs move that range, and a
    # kernel given it sees a buffer of exactly `nbytes`. Allocates nothing.
    def sub_bo(self, parent: BO, nbytes: int, offset: int = 0) -> BO: ...
    def compile(self, group: KernelGroup, out_dir: Path, mlir_text: str) -> list[str]: ...
    def load(self, artifact_dir: Path, group: KernelGroup) -> Kernel: ...
    # The device's `Recorder`, or None where its runs cannot be recorded (they are commands to
    # the NPU, or interpreted): its decode tokens then run call by call.
    def recorder(self) -> Recorder | None: ...


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, offset: int, nbytes: int) -> None:
    """Bytes [offset, offset + nbytes) of the contiguous byte buffer src into the same range of
    dst. A sync of a decode row moves a few KiB; after a GEMV has streamed its weights, slicing
    two views for it cost more than the copy, so small ranges go by pointer."""
    if nbytes <= _MEMMOVE_MAX:
        ctypes.memmove(dst.data_ptr() + offset, src.data_ptr() + offset, nbytes)
    else:
        dst[offset:offset + nbytes].copy_(src[offset:offset + nbytes])


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst ← src, both contiguous with one dtype and element count. A decode row (a few KiB)
    goes by one memmove: right after a GEMV has streamed its weights, a torch copy's dispatch
    costs tens of microseconds, mostly cache misses on the interpreter's side. Large tensors
    keep torch's copy, which uses every core."""
    n = dst.numel() * dst.element_size()
    if n <= _MEMMOVE_MAX:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)
