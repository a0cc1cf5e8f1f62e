"""Our side: the session `make run` builds, driven through the runtime's own step functions.

Nothing here re-implements a layer: `prefill` and `decode_step` are the functions
`Session.generate` calls, on the device model `build_session` built, so what passes
verification is exactly what is deployed. The per-layer outputs come from the runtime's
capture hook, which hands out views of reused device buffers; they are copied at once, and a
prompt longer than the largest bucket (prefilled chunk by chunk) has its chunks joined.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.session import Session
from npu_runtime.profiler import Profiler
from verify.runner import PrefillResult, StepResult


class OurRunner:
    def __init__(self, session: Session):
        self.session = session

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], keep_layers: bool = False) -> PrefillResult:
        chunks: dict[int, list[torch.Tensor]] = {}
        normed: list[torch.Tensor] = []

        def capture(layer: int, name: str, t: torch.Tensor) -> None:
            if name == "out":
                chunks.setdefault(layer, []).append(t.clone())
            elif name == "final_normed":
                normed.append(t.clone())

        logits = prefill(self.session.model, list(tokens), capture=capture if keep_layers else None)
        if not keep_layers:
            return PrefillResult(logits.clone())
        return PrefillResult(logits.clone(), [torch.cat(chunks[i]) for i in sorted(chunks)], normed[0])

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int) -> StepResult:
        return StepResult(decode_step(self.session.model, token, pos).clone())

    @torch.inference_mode()
    def decode_split(self, prompt: Sequence[int], n: int) -> dict:
        """A decode step's seconds inside the device's runs and in all (the rest is the host's
        share: attention, KV writes, the launches' own work, the head's rescoring), averaged over
        `n` greedy steps after `prompt`, once untimed first. The bench holds the host's share
        against the bandwidth bound: it is time the bound does not count and no GEMV can save.
        The profiler is on for these steps only; it adds its own few µs a call to the host's share
        (in a recorded decode, `llama_runtime.engine.recording`, two clock reads an op and the
        totals' bookkeeping once a token)."""
        model = self.session.model
        kc = model.kc
        saved = model.profiler, kc.profiler
        prof = model.profiler = kc.profiler = Profiler()
        try:
            for _ in range(2):
                tok, pos = self.prefill(prompt).top1, len(prompt)
                prof.reset()
                t0 = time.perf_counter()
                for _ in range(n):
                    tok = self.decode_step(tok, pos).top1
                    pos += 1
                elapsed = time.perf_counter() - t0
        finally:
            model.profiler, kc.profiler = saved
        device = sum(s.run_s for s in prof.groups.values())
        return {"steps": n, "step_s": elapsed / n, "device_run_s": device / n}

    @torch.inference_mode()
    def score(self, ids: Sequence[int]) -> tuple[list[float], list[int]]:
        """`verify.scoring`'s scorer: the first token prefilled, every later one fed as a decode
        step, so each prediction comes from the decode path (the fused 4-bit GEMV under
        QUANT=q4nx), the path that produces every generated token but the first."""
        ids = list(ids)
        nll, top1 = [], []
        logits = prefill(self.session.model, ids[:1])
        for pos in range(1, len(ids)):
            row = torch.log_softmax(logits.float(), dim=-1)
            nll.append(-float(row[ids[pos]]))
            top1.append(int(row.argmax()))
            if pos + 1 < len(ids):
                logits = decode_step(self.session.model, ids[pos], pos)
        return nll, top1
