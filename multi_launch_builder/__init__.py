"""Build time, one group at a time: stitch a group's per-launch modules into one multi-launch
module (`stitching`), validate it against the declaration (`mlir_validate`), and turn it into
an artifact (`compile`: the MLIR text everywhere, an ELF where aircc and Peano exist)."""
