"""The reference side: HF transformers' Llama in bf16 on the CPU, on the same checkpoint folder.

transformers is the implementation the checkpoints are published for, so it is the ground
truth for conventions (half-split RoPE, GQA grouping, Llama-3 frequency scaling, tied head).
It runs in bf16 like the runtime, so the gate measures implementation differences, not the
bf16-vs-f32 gap. Local files only, never remote code: verification must not execute or fetch
anything the checkpoint folder does not already contain.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from verify.runner import PrefillResult, StepResult


class HFRunner:
    def __init__(self, folder: str | Path, q4nx_folder: str | Path | None = None):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()        # a progress bar per load only clutters the gate's log
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.bfloat16, trust_remote_code=False, local_files_only=True
        ).eval()
        if q4nx_folder is not None:
            self._load_dequantized(Path(q4nx_folder))
        self._cache = None
        self._cached = 0

    @torch.no_grad()
    def _load_dequantized(self, q4nx_folder: Path) -> None:
        """Replace every layer's linear weights by the Q4NX weights dequantized (`q4nx.dequantize`:
        the bf16 numbers the runtime's GEMMs multiply), so the gate compares kernels, not the
        quantization. The head stays bf16: our 4-bit head only picks the candidates whose logits
        the host recomputes from the bf16 rows (`llama_runtime.engine.head_rescore`), so every logit the
        gate's top-5 ranks compare is the bf16 head's on both sides. A weight the build kept
        wide (bf16) is taken as it is stored."""
        from llama_base import q4nx
        from llama_base.tensor_names import parse_layer_tensor
        from llama_runtime.checkpoints.safetensors_io import Checkpoint

        ckpt = Checkpoint(q4nx_folder)
        for name, param in self.model.named_parameters():
            if parse_layer_tensor(name) is not None and param.dim() == 2:
                n, k = param.shape
                if ckpt.dtype_of(name) == "BF16":
                    param.copy_(ckpt.get(name, (n, k)))
                else:
                    param.copy_(q4nx.dequantize(ckpt.get_raw(name, (q4nx.nbytes(n, k),)), n, k))

    def _forward(self, ids: Sequence[int]) -> torch.Tensor:
        from transformers import DynamicCache

        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=torch.tensor([list(ids)]), past_key_values=self._cache, use_cache=True,
                         logits_to_keep=1)
        self._cached += len(ids)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], keep_layers: bool = False) -> PrefillResult:
        self._cache, self._cached = None, 0
        if not keep_layers:
            return PrefillResult(self._forward(tokens))
        layers: list[torch.Tensor] = []
        normed: list[torch.Tensor] = []
        inner = self.model.model
        # Forward hooks see each decoder layer's output before the next layer runs; the final
        # norm's hook gives what the LM head reads (HF's hidden_states tuple has no pre-norm
        # last layer, hence hooks rather than output_hidden_states).
        hooks = [layer.register_forward_hook(lambda _m, _i, out: layers.append(out[0].clone()))
                 for layer in inner.layers]
        hooks.append(inner.norm.register_forward_hook(lambda _m, _i, out: normed.append(out[0, -1].clone())))
        try:
            logits = self._forward(tokens)
        finally:
            for h in hooks:
                h.remove()
        return PrefillResult(logits, layers, normed[0])

    @torch.inference_mode()
    def score(self, ids: Sequence[int]) -> tuple[list[float], list[int]]:
        """`verify.scoring`'s scorer: one forward pass over the whole chunk, every row's logits kept."""
        self._cache, self._cached = None, 0
        logits = self.model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0, :-1].float()
        rows = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(list(ids[1:]))
        nll = -rows.gather(1, target[:, None])[:, 0]
        return nll.tolist(), rows.argmax(-1).tolist()

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int) -> StepResult:
        if pos != self._cached:
            raise ValueError(f"decode at position {pos}, but {self._cached} positions are cached")
        return StepResult(self._forward([token]))
