"""Build time, one launch at a time: the group declarations (`groups`, the contract between
build and run), tiling presets, one MLIR-AIR builder per launch op (`mlir/`), and the NPU C++
kernels (`kernels/`) with their extern contracts and their Peano and host builds."""
