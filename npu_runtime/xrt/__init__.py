"""The real NPU2 through pyxrt, and the NPU build target (aircc + Peano) it loads from."""
