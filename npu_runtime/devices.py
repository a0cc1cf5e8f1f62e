"""Which device a run gets: the NPU through pyxrt when one is usable, else the simulated NPU;
the MLIR-AIR interpreter only when asked for (it is for checking, and slow)."""
from __future__ import annotations

from llama_base.errors import DeviceUnavailableError
from npu_runtime.sim.device import SimDevice
from npu_runtime.xrt import device as xrt_device

DEVICE_KINDS = ("auto", "npu", "sim", "interp")


def open_device(kind: str = "auto", verbose: bool = True):
    """`auto` picks the NPU when pyxrt and an NPU2 are present, else the simulated device, and says which."""

    if kind not in DEVICE_KINDS:
        raise ValueError(f"DEVICE must be one of {', '.join(DEVICE_KINDS)} (got {kind!r})")
    if kind == "interp":
        from npu_runtime.interp.device import InterpDevice   # IREE's parser: only for this device

        dev, reason = InterpDevice(), "requested"
    elif kind == "sim":
        dev, reason = SimDevice(), "requested"
    else:
        found, reason = xrt_device.probe()
        if found:
            dev = xrt_device.XrtDevice()
        elif kind == "npu":
            # The user's request, not a fault: one `error:` line and exit status 2, like bad input.
            raise DeviceUnavailableError(f"DEVICE=npu but no usable NPU2: {reason}")
        else:
            dev = SimDevice()
    if verbose:
        why = "" if dev.kind == "npu" or kind == dev.kind else f" ({reason})"
        print(f"[device] {dev.name}{why}", flush=True)
    return dev
