"""The HF reference in a child process, handing its results back as safetensors + JSON.

Running the reference in its own process means its model is gone before ours is built, so a
verification's peak memory is the larger side's, not the sum (two 1B-shape models plus
activations would be about twice as much). Results travel as safetensors and JSON, never
pickle, so the parent only ever parses data.

Jobs: `trace` decodes each prompt greedily and returns the tokens with every step's logits;
`layers` prefills one prompt and returns every layer's output hidden state.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from verify import VerifyError
from verify.hf_runner import HFRunner
from verify.runner import run_trace

TENSORS_FILE = "hf.safetensors"
META_FILE = "hf.json"


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB.

    Linux's VmHWM first: a forked child's ru_maxrss starts from its parent's peak at fork
    time, which would credit the reference with memory the parent used before it started.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _run_job(job: dict) -> dict[str, torch.Tensor]:
    runner = HFRunner(job["folder"], job.get("q4nx"))
    if job["mode"] == "trace":
        out = {}
        for i, prompt in enumerate(job["prompts"]):
            trace = run_trace(runner, prompt, job["n_tokens"], set(job["end_ids"]))
            out[f"p{i}.tokens"] = torch.tensor(trace.tokens, dtype=torch.int64)
            out[f"p{i}.logits"] = trace.logits
        return out
    if job["mode"] == "layers":
        res = runner.prefill(job["prompts"][0], keep_layers=True)
        return {"layers": torch.stack(res.layers), "final_normed": res.final_normed, "logits": res.logits}
    raise ValueError(f"unknown job mode {job['mode']!r}")


def run_in_child(job: dict, workdir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Run `job` in a fresh interpreter; returns its tensors and metadata (time, peak memory)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "verify.hf_side", str(workdir)], env=env)
    if proc.returncode != 0:
        raise VerifyError(f"the HF reference process failed (exit {proc.returncode}); its error is above")
    meta = json.loads((workdir / META_FILE).read_text())
    return load_file(str(workdir / TENSORS_FILE)), meta


def main(argv: list[str] | None = None) -> int:
    workdir = Path((argv if argv is not None else sys.argv[1:])[0])
    job = json.loads((workdir / "job.json").read_text())
    t0 = time.perf_counter()
    tensors = _run_job(job)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(workdir / TENSORS_FILE))
    meta = {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(),
            "transformers": transformers.__version__, "torch": torch.__version__}
    (workdir / META_FILE).write_text(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
