"""The real NPU2 behind the device API, through pyxrt (imported only when present).

Artifacts are ELFs produced by aircc (`output_format = elf`): the instruction stream is inside
the ELF, so a run is just the BO list. pyxrt facts this relies on: `pyxrt.elf(path)`,
`pyxrt.hw_context(device, elf)`, `pyxrt.ext.kernel(context, "main:<func>")`,
`pyxrt.ext.bo(device, nbytes)`, `bo.map()`, `bo.sync(direction, nbytes, offset)`, and a
`pyxrt.run` with `set_arg` / `start` / `wait2`. A BO belongs to the device, not to a hardware
context, which is why one weight BO can serve the prefill and the decode kernels of a layer.

Not exercised on hardware in this repository's CI (no NPU there); the same interface is
exercised through the simulated device, and `tests/test_device.py` runs this path when
pyxrt and an NPU2 are present.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kernel_builder.groups import KernelGroup
from multi_launch_builder.compile import compile_elf, toolchain
from npu_runtime.api import Counters, DeviceError, Sync

# Device names XRT reports for NPU2-class (AIE2P) parts.
NPU2_NAMES = ("npu4", "npu5", "npu6", "strix", "krackan", "gorgon")


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
        return False, f"no XRT device ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if not any(n in name.lower() for n in NPU2_NAMES):
        return False, f"XRT device {name!r} is not an NPU2 (AIE2P)"
    return True, name


class XrtBO:
    def __init__(self, device: "XrtDevice", nbytes: int):
        import pyxrt

        self.size = nbytes
        self._counters = device.counters
        self._bo = pyxrt.ext.bo(device.handle, nbytes)
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
    def __init__(self, device: "XrtDevice", artifact_dir: Path, group: KernelGroup):
        import pyxrt

        meta = json.loads((artifact_dir / "npu.json").read_text())
        self.group = group
        self.device = device
        try:
            self._elf = pyxrt.elf(str(artifact_dir / meta["elf"]))
            self._ctx = pyxrt.hw_context(device.handle, self._elf)
            self._kernel = pyxrt.ext.kernel(self._ctx, meta["kernel"])
        except Exception as e:
            raise DeviceError(f"{artifact_dir}: cannot load {meta['elf']} on the NPU ({e})") from None
        self._completed = getattr(pyxrt.ert_cmd_state, "ERT_CMD_STATE_COMPLETED", None)

    def run(self, bos: list[XrtBO]) -> None:
        import pyxrt

        run = pyxrt.run(self._kernel)
        for i, bo in enumerate(bos):
            run.set_arg(i, bo._bo)
        run.start()
        state = run.wait2()
        # wait2 reports a timed-out or aborted run as a state, not an exception.
        if state is not None and self._completed is not None and state != self._completed:
            raise DeviceError(f"{self.group.name}: NPU run did not complete ({state})")
        self.device.counters.runs += 1


class NpuTarget:
    """Builds NPU artifacts (needs aircc and Peano, not an NPU): what `make compile` uses on a
    development machine, and what `XrtDevice` compiles with. Same cache key on both."""

    kind = "npu"

    def toolchain_stamp(self) -> str:
        return f"npu/{toolchain().stamp()}"

    def compile(self, group: KernelGroup, out_dir: Path, mlir_text: str | None) -> list[str]:
        """Stitched MLIR → aircc → ELF; the manifest lists every file so damage is detected."""
        if mlir_text is None:
            raise DeviceError(f"{group.name}: no MLIR to compile")
        mlir = out_dir / "group.mlir"
        mlir.write_text(mlir_text)
        result = compile_elf(mlir, out_dir, group)
        elf = Path(result["elf"])
        (out_dir / "npu.json").write_text(json.dumps({"elf": elf.name, "kernel": result["kernel"]}))
        return ["group.mlir", elf.name, "npu.json"]


class XrtDevice(NpuTarget):
    def __init__(self, index: int = 0):
        import pyxrt

        self.handle = pyxrt.device(index)
        self.name = f"NPU2 via XRT ({self.handle.get_info(pyxrt.xrt_info_device.name)})"
        self.counters = Counters()

    def bo(self, nbytes: int, kernel: XrtKernel | None = None, arg: int | None = None) -> XrtBO:
        """A host-visible BO. `pyxrt.ext.bo` places it for the NPU itself, so the kernel argument
        it is for (which the simulated device uses to choose a layout) changes nothing here."""
        self.counters.bos_allocated += 1
        self.counters.bytes_allocated += nbytes
        return XrtBO(self, nbytes)

    def load(self, artifact_dir: Path, group: KernelGroup) -> XrtKernel:
        return XrtKernel(self, artifact_dir, group)
