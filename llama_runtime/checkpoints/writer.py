"""Writing HF-style checkpoint folders (config, generation config, sharded safetensors).

The built-in models, GGUF imports and Q4NX weights are all written here; keeping the layout
rules in one place means every folder the runtime makes follows the same conventions, the ones
`from_pretrained` and the runtime's own reader (`safetensors_io.Checkpoint`) expect.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from llama_base.config import LlamaConfig

INDEX_FILE = "model.safetensors.index.json"


def write_configs(folder: Path, cfg: LlamaConfig, pad_token_id: int | None = None) -> None:
    """config.json plus a generation_config.json, so HF reference runs stop on the same end tokens."""
    config = cfg.to_dict()
    gen: dict = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if pad_token_id is not None:
        config["pad_token_id"] = gen["pad_token_id"] = pad_token_id
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def balanced_shards(nbytes: Mapping[str, int], n_shards: int) -> list[list[str]]:
    """Split tensor names, in their order, into `n_shards` runs of roughly equal byte size
    (`nbytes`: each tensor's size)."""
    total = sum(nbytes.values())
    shards: list[list[str]] = [[] for _ in range(n_shards)]
    running = 0
    for name, n in nbytes.items():
        # A tensor goes to the shard its first byte falls in.
        shards[min(running * n_shards // max(total, 1), n_shards - 1)].append(name)
        running += n
    return [s for s in shards if s]


def write_sharded(folder: Path, tensors: Mapping[str, torch.Tensor], shards: Sequence[Sequence[str]]) -> list[Path]:
    """Write `tensors` split as `shards` (lists of names) with a weight-map index.

    Each shard is written straight from the given tensors (safetensors serialises from their
    memory, no staging copy), so peak memory stays at the weights themselves.
    """
    from safetensors.torch import save_file

    names = [n for shard in shards for n in shard]
    if sorted(names) != sorted(tensors):
        raise ValueError("shards must list every tensor exactly once")
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        paths.append(folder / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def write_sharded_streaming(folder: Path, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                            make: Callable[[int], torch.Tensor], n_shards: int) -> None:
    """`specs` (name, dtype, shape) in `n_shards` files with a weight-map index, tensor `i`
    made by `make(i)` as its file is written: one tensor in memory at a time."""
    sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, dtype, shape in specs}
    index = {name: i for i, (name, *_) in enumerate(specs)}
    shards = balanced_shards(sizes, n_shards)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_streaming(folder / fname, [specs[index[n]] for n in shard],
                        ((n, make(index[n])) for n in shard), {"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": sum(sizes.values())},
                                                 "weight_map": weight_map}, indent=2) + "\n")


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}


def write_streaming(path: Path, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                    tensors: Iterable[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> None:
    """A safetensors file written one tensor at a time, as `tensors` yields them, in the order
    and with the dtypes and shapes `specs` announces: an import or a Q4NX build then holds one
    weight at a time, not the whole model (2.5 GB for Llama-3.2-1B in bf16) until a final
    `save_file`. Any other tensor, order, dtype or shape is a ValueError."""
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                     # the data starts 8-byte aligned
    it = iter(tensors)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for want, dtype, shape in specs:
            name, t = next(it, (None, None))
            if name != want or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                got = "nothing" if name is None else f"{name} {t.dtype} {list(t.shape)}"
                raise ValueError(f"{path}: expected {want} {dtype} {list(shape)}, got {got}")
            f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
    if next(it, None) is not None:
        raise ValueError(f"{path}: more tensors than announced")
