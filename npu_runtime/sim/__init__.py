"""The simulated NPU: the device API on the CPU (BOs with separate host and device copies) and
the reference ops its launch programs run, on the CPU kernels of `cpu_kernels`."""
