"""The MLIR-AIR interpreter device: executes the stitched group modules themselves (every core
of every herd, every DMA as written, external kernels from their C++ sources' host builds),
checking what hardware would silently get wrong. Meant for small shapes; see docs/explain.md."""
