"""A stand-in for pyxrt, for tests only: the API surface `npu_runtime/xrt/device.py` uses, with
kernels that compute by the simulated device's rules, and a log of every call.

No NPU, driver or pyxrt exists where the suite runs, so the XRT code would otherwise never
execute. This fake makes it execute for real: `XrtDevice`, `XrtKernel` and `XrtBO` run
unchanged, their BOs hold host and device copies apart exactly as the simulator's do (a
missing sync is visible), and a run executes the group with `npu_runtime.sim`'s kernels.
What it cannot tell is whether real XRT behaves as assumed; it pins down what this code asks
of XRT (`calls`), so a test can check the protocol.

The "ELF" a fake compile writes is the group's declaration as JSON (`elf_bytes`); loading it
rebuilds nothing from it but checks it names a group the test registered (`register`).
"""
from __future__ import annotations

import enum
import json
import types
import weakref
from pathlib import Path

import numpy as np
import torch

from npu_runtime.api import Sync
from npu_runtime.sim.device import SimDevice, SimKernel

NPU_NAME = "NPU Strix"      # what amdxdna reports for an NPU4-family (AIE2P) part


class xrt_info_device(enum.Enum):   # noqa: N801 (pyxrt's spelling)
    name = "name"


class xclBOSyncDirection(enum.Enum):   # noqa: N801
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


class ert_cmd_state(enum.Enum):   # noqa: N801
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_TIMEOUT = 8


class FakeXrt:
    """The module's state: registered groups, the call log, open contexts and injected faults."""

    def __init__(self):
        self.groups: dict[str, object] = {}
        self.calls: list[tuple] = []
        self.open_contexts = 0
        self.max_open_contexts = 0
        self.fail_elf: str | None = None          # message pyxrt.elf raises
        self.fail_run_state: ert_cmd_state | None = None
        self.sim = SimDevice()
        self._kernels: dict[str, SimKernel] = {}

    def register(self, group) -> None:
        self.groups[group.name] = group

    @staticmethod
    def elf_bytes(group) -> bytes:
        return json.dumps({"group": group.name, "program": group.to_json()}, sort_keys=True).encode()

    def sim_kernel(self, name: str) -> SimKernel:
        if name not in self._kernels:
            self._kernels[name] = SimKernel(self.sim, self.groups[name])
        return self._kernels[name]

    def module(self) -> types.ModuleType:
        """A fresh `pyxrt` module object bound to this state."""
        state = self
        m = types.ModuleType("pyxrt")
        m.xrt_info_device = xrt_info_device
        m.xclBOSyncDirection = xclBOSyncDirection
        m.ert_cmd_state = ert_cmd_state

        class device:   # noqa: N801
            def __init__(self, index: int):
                state.calls.append(("device", index))
                self.index = index

            def get_info(self, key):
                assert key is xrt_info_device.name, key
                return NPU_NAME

        class elf:   # noqa: N801
            def __init__(self, path: str):
                state.calls.append(("elf", path))
                if state.fail_elf:
                    raise RuntimeError(state.fail_elf + "\n(driver detail on a second line)")
                meta = json.loads(Path(path).read_bytes())
                if meta["group"] not in state.groups:
                    raise RuntimeError(f"unknown program {meta['group']}")
                if meta["program"] != json.loads(json.dumps(state.groups[meta["group"]].to_json())):
                    raise RuntimeError(f"program of {meta['group']} does not match its declaration")
                self.group = meta["group"]

        class hw_context:   # noqa: N801
            def __init__(self, dev, the_elf):
                assert isinstance(dev, device) and isinstance(the_elf, elf)
                state.calls.append(("hw_context", the_elf.group))
                self.group = the_elf.group
                state.open_contexts += 1
                state.max_open_contexts = max(state.max_open_contexts, state.open_contexts)
                weakref.finalize(self, state._closed, the_elf.group)

        class _Kernel:
            def __init__(self, ctx, name: str):
                assert isinstance(ctx, hw_context)
                state.calls.append(("kernel", name))
                if name != f"main:{ctx.group}":
                    raise RuntimeError(f"no kernel {name} in the ELF of {ctx.group}")
                self.ctx, self.name, self.group = ctx, name, ctx.group

        class _BO:
            def __init__(self, dev, nbytes: int):
                assert isinstance(dev, device)
                state.calls.append(("bo", id(self), nbytes))
                self.nbytes = nbytes
                self.sim_bo = state.sim.bo(nbytes)
                self._host = np.zeros(nbytes, dtype=np.uint8)

            def map(self):
                return memoryview(self._host)

            def sync(self, direction, nbytes: int, offset: int):
                assert isinstance(direction, xclBOSyncDirection)
                assert 0 <= offset and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
                state.calls.append(("sync", id(self), direction.name, nbytes, offset))
                span = torch.from_numpy(self._host[offset:offset + nbytes])
                host = self.sim_bo.map()[offset:offset + nbytes]
                if direction is xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
                    host.copy_(span)
                    self.sim_bo.sync(Sync.TO_DEVICE, nbytes, offset)
                else:
                    self.sim_bo.sync(Sync.FROM_DEVICE, nbytes, offset)
                    span.copy_(host)

        class bo(_BO):   # noqa: N801 (pyxrt.bo; only its sub-buffer constructor is used)
            def __init__(self, parent, nbytes: int, offset: int):
                assert isinstance(parent, _BO)
                if not (nbytes > 0 and offset >= 0 and offset + nbytes <= parent.nbytes):
                    raise RuntimeError("sub buffer size and offset")
                state.calls.append(("sub_bo", id(self), nbytes, id(parent), offset))
                self.nbytes, self.parent = nbytes, parent
                self.sim_bo = state.sim.sub_bo(parent.sim_bo, nbytes, offset)
                self._host = parent._host[offset:offset + nbytes]     # the parent's memory, as XRT's map is

        class run:   # noqa: N801 (XRT: a run may be started again once its last start completed)
            def __init__(self, kernel):
                assert isinstance(kernel, _Kernel)
                self.kernel, self.args, self.pending = kernel, {}, False
                state.calls.append(("run_created", kernel.name))

            def set_arg(self, i: int, bo):
                assert isinstance(bo, _BO)
                state.calls.append(("set_arg", self.kernel.name, i, id(bo)))
                self.args[i] = bo

            def start(self):
                assert not self.pending, "started again before the last start was waited for"
                k = self.kernel
                bos = [self.args[i] for i in range(len(self.args))]
                state.calls.append(("run", k.name, tuple(id(b) for b in bos)))
                self.pending = True
                if state.fail_run_state is None:
                    state.sim_kernel(k.group).run([b.sim_bo for b in bos])

            def wait2(self):
                self.pending = False
                return state.fail_run_state or ert_cmd_state.ERT_CMD_STATE_COMPLETED

        m.device, m.elf, m.hw_context, m.run, m.bo = device, elf, hw_context, run, bo
        m.ext = types.SimpleNamespace(bo=_BO, kernel=_Kernel)
        return m

    def _closed(self, group: str) -> None:
        self.open_contexts -= 1
        self.calls.append(("context_closed", group))
