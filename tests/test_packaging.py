"""The package as pip installs it, not as the editable checkout runs it.

`make install` installs in editable mode, which imports every folder of the checkout whether
pyproject lists it or not; a subpackage or data file missing from the list shows up only in a
non-editable install. Here the repository is built and installed into a venv of its own
(`--no-deps`: the dependencies come from this environment, added to the new venv's path
without this environment's editable finder), and the installed copy runs the interpreter
device end to end from a folder outside the checkout: the stitched MLIR from the installed
builders, the host builds of the installed C++ kernels, the native CPU library.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from llama_base.paths import ENV_CACHE
from llama_runtime.checkpoints import builtin

REPO = Path(__file__).resolve().parents[1]
# What a checkout holds besides the sources: never part of a build.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "reports")
INSTALL_TIMEOUT_S = 600

# Run by the installed interpreter: every file a run needs is in the venv, none from the checkout.
CHECK_INSTALLED = """
import sys
from pathlib import Path
import cpu_kernels, kernel_builder, llama_runtime, llama_runtime.serve, npu_runtime.interp
venv = Path(sys.prefix).resolve()
for mod in (cpu_kernels, kernel_builder, llama_runtime, npu_runtime.interp):
    assert venv in Path(mod.__file__).resolve().parents, (mod.__name__, mod.__file__)
data = {kernel_builder: "kernels/gemv_bf16.cc", cpu_kernels: "native/simd_bf16.h", llama_runtime.serve: "web/chat.html"}
missing = [f"{m.__name__}/{f}" for m, f in data.items() if not (Path(m.__file__).parent / f).is_file()]
assert not missing, missing
print("installed in", venv)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The interpreter of a venv holding a non-editable install of the repository."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=NOT_SOURCES)          # the build writes build/ into its source
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # A plain path line: this environment's packages are importable, its .pth files (the
    # editable finder among them) are not run.
    (purelib / "project-dependencies.pth").write_text(
        "\n".join(dict.fromkeys([sysconfig.get_paths()["purelib"], *site.getsitepackages()])) + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "--ignore-installed", str(src)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return py


@pytest.mark.slow
def test_a_non_editable_install_holds_every_package_and_data_file(installed, tmp_path):
    r = subprocess.run([str(installed), "-c", CHECK_INSTALLED], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_a_non_editable_install_runs_the_interpreter_device(installed, tmp_path):
    models = builtin.ensure_tiny_checkpoint().parent        # built once, shared with the other tests
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / models.name).symlink_to(models)                 # kernels and host builds start empty
    env = {**os.environ, ENV_CACHE: str(cache), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([str(installed), "-m", "llama32_1b_inference", "--model", "tiny", "--device", "interp",
                        "--prompt", "hi", "-n", "2"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "MLIR-AIR interpreter" in r.stdout and "2 tokens" in r.stdout, r.stdout
    assert any((cache / "host_kernels").iterdir()) and any((cache / "kernels" / "interp").iterdir())
