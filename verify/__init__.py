"""Numerical verification of the runtime against HF transformers on the same checkpoint.

`python -m verify` is the top-k gate (teacher-forced greedy decoding, both directions of
top-5 membership); `python -m verify.diagnosis` compares every layer's output hidden state
on one prompt. The HF side runs in a child process and hands its results over as
safetensors + JSON, so the two models are never resident at once.
"""
from llama_base.errors import UserError


class VerifyError(UserError):
    """Verification could not run (as opposed to ran and found a difference)."""
