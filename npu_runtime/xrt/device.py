"""The real NPU2 behind the device API, through pyxrt (imported only when present).

Artifacts are ELFs produced by aircc (`output_format = elf`): the instruction stream is inside
the ELF, so a run is just the BO list. pyxrt facts this relies on: `pyxrt.elf(path)`,
`pyxrt.hw_context(device, elf)`, `pyxrt.ext.kernel(context, "main:<func>")`,
`pyxrt.ext.bo(device, nbytes)`, `pyxrt.bo(parent, nbytes, offset)` (a sub-buffer), `bo.map()`,
`bo.sync(direction, nbytes, offset)`, and a `pyxrt.run` with `set_arg` / `start` / `wait2`, which
may be started again once it completed (`xrt_kernel.h`: a run handle "can be re-used"). A BO
belongs to the device, not to a hardware context, which is why one weight BO can serve the
prefill and the decode kernels of a layer. A sub-buffer is how the prefill buckets share their
activation memory while each kernel still gets a BO of the size its argument declares: in XRT's
`xrt_bo.cpp` (`buffer_sub`) its host pointer and device address are the parent's plus the
offset and its syncs go through the parent; that the NPU driver takes a sub-buffer's address
as a kernel argument like any BO's is assumed, not observed.

Hardware contexts are bounded: each one claims the whole array, and the NPU driver admits a
fixed number per device across all processes (`hwctx_limit` 16 for the NPU4 family, Strix
and Krackan, in amd/xdna-driver's `npu4_family.h`). A session has far more groups than that
(three per prefill bucket, attention at several contexts, decode, the LM head), so a kernel
opens its context when it runs and the least recently used one is closed beyond
`max_contexts` (default `DEFAULT_MAX_HW_CONTEXTS`, half the driver's limit so other NPU users
keep room; `$LLAMA_NPU_MAX_HW_CONTEXTS` overrides it).

Never run on hardware in this repository (no NPU there). `tests/test_xrt_fake.py` runs this
module against a recording stand-in for pyxrt whose kernels compute with the simulator, and
`tests/test_device.py` runs this path when pyxrt and an NPU2 are present.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from llama_base.group_contract import KernelGroup
from npu_runtime.api import Counters, DeviceError, Sync

# Device names XRT reports for NPU2-class (AIE2P) parts.
NPU2_NAMES = ("npu4", "npu5", "npu6", "strix", "krackan", "gorgon")
# The NPU artifact's format: with the group and the builder sources it decides the ELF's
# contents; which aircc built it is recorded in the cache manifest, not keyed on.
ARTIFACT_STAMP = "npu2-elf-v1"
DEFAULT_MAX_HW_CONTEXTS = 8
ENV_MAX_HW_CONTEXTS = "LLAMA_NPU_MAX_HW_CONTEXTS"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def probe() -> tuple[bool, str]:
    """(usable, reason): pyxrt importable and device 0 an NPU2."""
    try:
        import pyxrt  # noqa: F401
    except ImportError:
        return False, "pyxrt is not installed"
    try:
        dev = pyxrt.device(0)
        name = str(dev.get_info(pyxrt.xrt_info_device.name))
    except Exception as e:  # pyxrt raises RuntimeError subclasses with driver text
        return False, f"no XRT device ({_first_line(e)})"
    if not any(n in name.lower() for n in NPU2_NAMES):
        return False, f"XRT device {name!r} is not an NPU2 (AIE2P)"
    return True, name


class XrtBO:
    def __init__(self, device: "XrtDevice", nbytes: int, parent: "XrtBO | None" = None, offset: int = 0):
        import pyxrt

        self.size = nbytes
        self._counters = device.counters
        if parent is None:
            self._bo = pyxrt.ext.bo(device.handle, nbytes)
        else:
            if nbytes <= 0 or offset < 0 or offset + nbytes > parent.size:
                raise DeviceError(f"a sub-buffer of {nbytes} bytes at {offset} does not fit a {parent.size}-byte BO")
            self._bo = pyxrt.bo(parent._bo, nbytes, offset)
        self.parent = parent          # a sub-buffer keeps its parent alive (XRT's does too)
        self._map = torch.from_numpy(np.frombuffer(self._bo.map(), dtype=np.uint8))
        self._dirs = {Sync.TO_DEVICE: pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE,
                      Sync.FROM_DEVICE: pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE}

    def map(self) -> torch.Tensor:
        return self._map

    def write(self, data: torch.Tensor, offset: int = 0) -> None:
        raw = data.contiguous().view(torch.uint8).reshape(-1)
        self._map[offset:offset + raw.numel()].copy_(raw)

    def read(self, nbytes: int | None = None, offset: int = 0) -> torch.Tensor:
        end = self.size if nbytes is None else offset + nbytes
        return self._map[offset:end].clone()

    def sync(self, direction: Sync, nbytes: int | None = None, offset: int = 0) -> None:
        n = self.size - offset if nbytes is None else nbytes
        if direction is Sync.TO_DEVICE:
            self._counters.bytes_to_device += n
        else:
            self._counters.bytes_from_device += n
        self._bo.sync(self._dirs[direction], n, offset)


class XrtKernel:
    """A group's ELF, parsed at load; its hardware context is opened only while the device's
    context budget has room for it (see `XrtDevice.activate`)."""

    def __init__(self, device: "XrtDevice", artifact_dir: Path, group: KernelGroup):
        import pyxrt

        meta = json.loads((artifact_dir / "npu.json").read_text())
        self.group = group
        self.device = device
        self.kernel_name = meta["kernel"]
        self._ctx = self._kernel = None
        # One pyxrt.run per BO list, its arguments set once: "a run handle can be re-used to
        # execute the same kernel again" (XRT's xrt_kernel.h, class run). A layer's BO set is the
        # same list on every call, so a call is start and wait. Each entry holds its BOs, so an
        # id in a key cannot be reused by a newer BO while the entry lives.
        self._runs: dict[tuple[int, ...], tuple[object, tuple[XrtBO, ...]]] = {}
        try:
            self._elf = pyxrt.elf(str(artifact_dir / meta["elf"]))
        except Exception as e:
            raise DeviceError(f"{artifact_dir}: cannot load {meta['elf']} on the NPU ({_first_line(e)})") from None
        self._completed = getattr(pyxrt.ert_cmd_state, "ERT_CMD_STATE_COMPLETED", None)
        device.activate(self)        # a context the driver refuses is a load error, not a run error

    @property
    def is_open(self) -> bool:
        return self._kernel is not None

    def open(self) -> None:
        import pyxrt

        try:
            self._ctx = pyxrt.hw_context(self.device.handle, self._elf)
            self._kernel = pyxrt.ext.kernel(self._ctx, self.kernel_name)
        except Exception as e:
            self._ctx = self._kernel = None
            raise DeviceError(f"{self.group.name}: cannot open a hardware context ({_first_line(e)})") from None

    def close(self) -> None:
        """Drop the runs, the kernel and then its context: the last reference releases the
        driver's context."""
        self._runs.clear()
        self._kernel = None
        self._ctx = None

    def run(self, bos: list[XrtBO]) -> None:
        import pyxrt

        self.device.activate(self)
        key = tuple(id(bo) for bo in bos)
        held = self._runs.get(key)
        if held is None:
            run = pyxrt.run(self._kernel)
            for i, bo in enumerate(bos):
                run.set_arg(i, bo._bo)
            held = self._runs[key] = (run, tuple(bos))
        run = held[0]
        run.start()
        state = run.wait2()
        # wait2 reports a timed-out or aborted run as a state, not an exception. Such a run may
        # still be in flight, so it is not started again: the next call builds a new one.
        if state is not None and self._completed is not None and state != self._completed:
            del self._runs[key]
            raise DeviceError(f"{self.group.name}: NPU run did not complete ({state})")
        self.device.counters.runs += 1


class NpuTarget:
    """Builds NPU artifacts (needs aircc and Peano, not an NPU): what `make compile` uses on a
    development machine, and what `XrtDevice` compiles with. Same cache key on both."""

    kind = "npu"
    # A valid entry that XRT refuses is an XRT problem; a rebuild would fail the same way.
    rebuild_on_load_error = False
    key_on_module_text = False    # its artifacts follow from the declaration and the builders

    def toolchain_stamp(self) -> str:
        return ARTIFACT_STAMP

    def toolchain_description(self) -> str:
        """Which aircc/aiecc/Peano (paths and mtimes) built an entry: recorded, not keyed on."""
        from multi_launch_builder.compile import toolchain   # the build side, only when building

        return toolchain().stamp()

    def compile(self, group: KernelGroup, out_dir: Path, mlir_text: str | None) -> list[str]:
        """Stitched MLIR → aircc → ELF; the manifest lists every file so damage is detected."""
        if mlir_text is None:
            raise DeviceError(f"{group.name}: no MLIR to compile")
        mlir = out_dir / "group.mlir"
        mlir.write_text(mlir_text)
        from multi_launch_builder.compile import compile_elf

        result = compile_elf(mlir, out_dir, group)
        elf = Path(result["elf"])
        (out_dir / "npu.json").write_text(json.dumps({"elf": elf.name, "kernel": result["kernel"]}))
        return ["group.mlir", elf.name, "npu.json"]


def max_contexts_setting() -> int:
    env = os.environ.get(ENV_MAX_HW_CONTEXTS)
    if not env:
        return DEFAULT_MAX_HW_CONTEXTS
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_MAX_HW_CONTEXTS} must be a positive integer (got {env!r})")
    return n


class XrtDevice(NpuTarget):
    def __init__(self, index: int = 0, max_contexts: int | None = None):
        import pyxrt

        self.handle = pyxrt.device(index)
        self.name = f"NPU2 via XRT ({self.handle.get_info(pyxrt.xrt_info_device.name)})"
        self.counters = Counters()
        self.max_contexts = max_contexts if max_contexts is not None else max_contexts_setting()
        self._open: OrderedDict[int, XrtKernel] = OrderedDict()   # id -> kernel, least recent first

    def activate(self, kernel: XrtKernel) -> None:
        """Make `kernel`'s context open, closing the least recently used beyond the budget.

        Runs are synchronous (`wait2` returns before the next call), so a closed context has
        no command in flight; its BOs belong to the device and stay valid.
        """
        key = id(kernel)
        if key in self._open and kernel.is_open:
            self._open.move_to_end(key)
            return
        self._open.pop(key, None)
        while len(self._open) >= self.max_contexts:
            _, old = self._open.popitem(last=False)
            old.close()
        kernel.open()
        self._open[key] = kernel

    @property
    def open_contexts(self) -> int:
        return len(self._open)

    def bo(self, nbytes: int, kernel: XrtKernel | None = None, arg: int | None = None) -> XrtBO:
        """A host-visible BO. `pyxrt.ext.bo` places it for the NPU itself, so the kernel argument
        it is for (which the simulated device uses to choose a layout) changes nothing here."""
        self.counters.bos_allocated += 1
        self.counters.bytes_allocated += nbytes
        return XrtBO(self, nbytes)

    def sub_bo(self, parent: XrtBO, nbytes: int, offset: int = 0) -> XrtBO:
        """Bytes [offset, offset + nbytes) of `parent` as a BO (`pyxrt.bo(parent, nbytes, offset)`)."""
        return XrtBO(self, nbytes, parent, offset)

    def load(self, artifact_dir: Path, group: KernelGroup) -> XrtKernel:
        return XrtKernel(self, artifact_dir, group)

    def recorder(self) -> None:
        """None: a run is a command the NPU executes, with the host's syncs around it; there is
        nothing the host could replay in its place."""
        return None
