"""Kernel groups, devices and the KernelCache: everything between the model code and the NPU."""
