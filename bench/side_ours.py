"""Child process: this runtime, built the way `make run` builds it, driven by its step functions.

`OurRunner` calls the same `prefill` and `decode_step` that `Session.generate` calls, on the
session `build_session` returns, so the bench times exactly what is deployed.
"""
from __future__ import annotations

from bench.protocol import child_main


def make_runner(job: dict):
    from llama32_1b_inference import build_session
    from verify.our_runner import OurRunner

    session = build_session(job["model"], device=job["device"], max_context=job["max_context"], log=lambda _: None,
                            quant=job.get("quant", "bf16"), decode=job.get("decode", "auto"))
    info = {"device": session.device.name, "buckets": list(session.model.buckets),
            "max_context": session.model.max_context, "kv_cache_bytes": session.model.kv.nbytes,
            "resident_bytes": session.kc.resident_bytes(), "build_s": session.build_s,
            "quant": job.get("quant", "bf16"), "kernels_compiled": session.kc.stats.compiled,
            "decode": session.model.decode}
    return OurRunner(session), info


if __name__ == "__main__":
    raise SystemExit(child_main(make_runner))
