"""The native CPU kernels: the C++ sources (`native/`), their build per ISA class and the choice
of the best class this CPU runs (`native_build`, `native_cpu`), and the packed-weight layout
they read (`weight_tiles`).

Two callers sit above it and neither owns it: the simulated NPU runs its launches on these
kernels, and the host ops (decode attention, the final RMSNorm, the KV row store) run on them
on every device, the NPU included.
"""
