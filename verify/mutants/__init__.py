"""Mutation testing of the MLIR-AIR checks: `python -m verify.mutants` (`make mutants`)."""
