"""A 4-bit LM head's leading logits, recomputed from the bf16 rows the host holds anyway.

Decode reads the whole LM head every token, so with Q4NX weights it is quantized too: kept in
bf16 it would cost Llama-3.2-1B as many bytes a token as every layer's Q4NX weights together.
But the head is where 4-bit rounding shows most: on the embedded model (the one trained model
on every machine), a Q4NX head alone costs several times the perplexity of all Q4NX layers
together and changes the top-1 token at a fifth of positions (docs/explain.md has the figures).
The logits that decide a token are few, though, and the bf16 rows that compute them exactly
exist already: a tied head is the embedding table the host reads for every token's lookup (an
untied one stays in its checkpoint file); they are read from the file
(`safetensors_io.FileRows`), so only the last `ROW_CACHE_BYTES` of them stay resident: the
candidates of one token recur in the next ones. So after the device's 4-bit GEMV,
the `TOP_K` highest logits are recomputed on the host from those rows, f32 sums rounded to bf16
as the GEMV rounds: 256 rows (1 MiB for Llama-3.2-1B) against the 164 MB the 4-bit head
streams, which brings the perplexity and the top-1 agreement back to the level of Q4NX layers
with a bf16 head.

What stays approximate: logits outside the candidates keep the 4-bit head's values, so the
probabilities of unlikely tokens (a sampler's tail, their logprobs) carry its error, and a token
whose exact logit would lead but whose 4-bit logit falls below the 256th is missed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from cpu_kernels import native_rows
from llama_runtime.checkpoints.safetensors_io import FileRows

TOP_K = 256
# The rows read last, kept for the next tokens (4096 rows of Llama-3.2-1B's head). On the one
# trained model here (SmolLM2, 14 563 of its rows) they held 90 % of the candidates of a 300-token
# greedy generation; on random weights of the 1B shape, whose candidates barely recur, 19 %.
ROW_CACHE_BYTES = 16 << 20


def rescore(logits: torch.Tensor, normed: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor],
            k: int = TOP_K, source: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite the `k` highest of `logits` (f32 [vocab]) with bf16-rounded `rows(ids) · normed`,
    where `rows` gives the bf16 head rows of the ids asked for; returns those ids. With `source`
    (the head's bf16 logits), `logits` is only the f32 tensor to fill: it receives `source`
    widened first. A `FileRows` does it all in one call where it can (`FileRows.rescore`,
    with the same numbers)."""
    k = min(k, logits.numel())
    idx = rows.rescore(logits, normed, k, source) if isinstance(rows, FileRows) else None
    if idx is not None:
        return idx
    if source is not None:
        logits.copy_(source)
    idx = native_rows.top_k_ids(logits, k)
    if idx is None:
        idx = torch.topk(logits, k, sorted=False).indices
    picked = rows(idx)
    exact = native_rows.rows_dot(picked, normed)
    if exact is None:
        exact = picked.float() @ normed.float()
    logits.index_copy_(0, idx, exact.to(torch.bfloat16).float())
    return idx
