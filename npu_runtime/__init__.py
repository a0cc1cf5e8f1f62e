"""Run time, device side: the device API, the devices behind it (simulated, XRT), the
KernelCache that builds, keeps and runs groups on them, and the profiler that times it."""
