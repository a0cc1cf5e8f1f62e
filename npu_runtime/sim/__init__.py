"""The simulated NPU: the device API on the CPU, its reference ops, and the native CPU library
(packed weights, GEMM, GEMV, elementwise, attention) those ops and the host ops call."""
