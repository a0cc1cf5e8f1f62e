"""Which device a run gets: the NPU through pyxrt when one is usable, else the simulated NPU."""
from __future__ import annotations

from npu_runtime.api import DeviceError
from npu_runtime.sim.device import SimDevice
from npu_runtime.xrt import device as xrt_device


def open_device(kind: str = "auto", verbose: bool = True):
    """`auto` picks the NPU when pyxrt and an NPU2 are present, else the simulated device, and says which."""

    if kind not in ("auto", "npu", "sim"):
        raise ValueError(f"DEVICE must be auto, npu or sim (got {kind!r})")
    if kind == "sim":
        dev = SimDevice()
        reason = "requested"
    else:
        found, reason = xrt_device.probe()
        if found:
            dev = xrt_device.XrtDevice()
        elif kind == "npu":
            raise DeviceError(f"DEVICE=npu but no usable NPU2: {reason}")
        else:
            dev = SimDevice()
    if verbose:
        why = "" if dev.kind == "npu" or kind == "sim" else f" ({reason})"
        print(f"[device] {dev.name}{why}", flush=True)
    return dev
