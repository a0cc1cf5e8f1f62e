"""Child process: this runtime, built the way `make run` builds it, driven by its step functions.

`OurRunner` calls the same `prefill` and `decode_step` that `Session.generate` calls, on the
session `build_session` returns, so the bench times exactly what is deployed. The job's
`decode` is `build_session`'s (auto, layers or fused); the mode it chose is reported.
"""
from __future__ import annotations

from bench.protocol import child_main
from verify.our_runner import OurRunner


class BenchRunner(OurRunner):
    """`OurRunner` with what only the bench asks of our side: the kernel groups a depth sweep
    calls compiled ahead of its timed children, and what a run compiled."""

    def compile_depths(self, depths: list[int], n_decode: int) -> int:
        """Compile, without running, every group the prompts of `depths` and the `n_decode`
        steps after each would compile on first use: the attention of each chunk at its offset
        (a prompt past the largest bucket goes chunk by chunk, `prefill`), and with the fused
        decode each window its steps reach. Returns the groups compiled (0: all were cached)."""
        model = self.session.model
        before = model.kc.stats.compiled
        step = model.buckets[-1]
        for depth in depths:
            for start in range(0, depth, step):
                n = min(step, depth - start)
                model.attention_group(model.bucket_for(n), start, n)
            if model.resident:
                for pos in range(depth, depth + n_decode):
                    model.fused_group(pos)
        return model.kc.stats.compiled - before

    def facts(self) -> dict:
        from cpu_kernels import threads

        return {"kernels_compiled": self.session.kc.stats.compiled, "threads": threads.governor().describe()}


def make_runner(job: dict):
    from llama32_1b_inference import build_session

    session = build_session(job["model"], device=job["device"], max_context=job["max_context"], log=lambda _: None,
                            quant=job.get("quant", "bf16"), decode=job.get("decode", "auto"),
                            threads=job.get("threads"))
    info = {"device": session.device.name, "buckets": list(session.model.buckets),
            "max_context": session.model.max_context, "kv_cache_bytes": session.model.kv.nbytes,
            "resident_bytes": session.kc.resident_bytes(), "build_s": session.build_s,
            "quant": job.get("quant", "bf16"), "decode": session.model.decode,
            "kernels_compiled": session.kc.stats.compiled}
    return BenchRunner(session), info


if __name__ == "__main__":
    raise SystemExit(child_main(make_runner))
