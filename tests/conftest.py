"""Shared fixtures: a tiny Llama config for fast device/cache tests, and isolated cache roots."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.weights import synthetic_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, vocab_size=250, max_position_embeddings=1024,
                   bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="session")
def tiny_config() -> LlamaConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_weights():
    return synthetic_weights(TINY, seed=3)


def _native_isas() -> list[str]:
    """The ISA classes the native-kernel tests run under: every one this CPU runs, so that an
    AVX-512 CI host also covers the AVX2 kernels, and the emulated AMX tiles; only the one asked
    for when LLAMA_NPU_ISA (or LLAMA_NPU_NATIVE=0) picks one; torch alone where there are none."""
    from cpu_kernels import native_cpu

    asked = native_cpu._requested()
    if asked is not None:
        return [asked]
    return native_cpu.supported_isas() + native_cpu.emulated_isas() or [native_cpu.TORCH]


@pytest.fixture(params=_native_isas())
def native_isa(request):
    from cpu_kernels import native_cpu

    with native_cpu.use_isa(request.param):
        yield request.param


def _sim_paths() -> list[str]:
    """The simulator's ways of running a launch: each native ISA class above, and its torch bodies."""
    from cpu_kernels import native_cpu

    return list(dict.fromkeys(_native_isas() + [native_cpu.TORCH]))


@pytest.fixture(params=_sim_paths())
def sim_path(request):
    from cpu_kernels import native_cpu

    with native_cpu.use_isa(request.param):
        yield request.param


@pytest.fixture(scope="session")
def disassemble():
    """`objdump -d` of a library, as the tests that read instructions want it. Skips without
    objdump."""
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed")
    return lambda path: subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True,
                                       text=True, check=True).stdout


@pytest.fixture(scope="session")
def class_disassembly(disassemble) -> dict[str, str]:
    """`objdump -d` of every class's library, built if need be: what tests read for the
    instructions a class holds. Skips without objdump or a compiler that builds every class."""
    from cpu_kernels import native_build

    paths = {isa: native_build.library_path(isa) for isa in native_build.ALL_CLASSES}
    if None in paths.values():
        pytest.skip("no C++ compiler (or none that knows AMX)")
    return {isa: disassemble(p) for isa, p in paths.items()}
