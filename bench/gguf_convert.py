"""The benchmarked checkpoint as GGUF, through the converter llama-cpp-python's sdist carries.

llama.cpp must run the very weights the other runtimes run, so its GGUF is converted from the
same checkpoint folder rather than taken from anywhere else. The converter runs as a child
process of the project's interpreter (it needs torch and transformers) with the llama.cpp
build's extra converter dependencies on its path.

The converter insists that every tokenizer id fits the model's vocabulary. The Llama 3.2
tokenizer files come from the vision model and carry one extra id past the text model's
vocabulary (`<|image|>`), which the text model can never see; the conversion therefore reads
a staging folder that links the checkpoint's files and holds tokenizer files trimmed to the
config's `vocab_size`. Results are cached per checkpoint contents, converter version and type.

The 4-bit types (`bench.llamacpp_quantize.FTYPES`) are not converter output types: they are made
from the bf16 conversion by llama.cpp's own quantizer, as a llama.cpp user makes them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from bench import BenchError
from bench.llamacpp_build import LlamaCpp
from bench.llamacpp_quantize import FTYPES
from bench.protocol import PROJECT_ROOT, child_env
from llama_base.paths import bench_dir

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def trim_tokenizer_files(src: Path, dest: Path, vocab_size: int) -> list[str]:
    """Copy the tokenizer files into `dest` without ids >= vocab_size; returns the files changed."""
    changed = []
    tj = src / TOKENIZER_JSON
    if tj.is_file():
        data = json.loads(tj.read_text())
        added = data.get("added_tokens") or []
        vocab = (data.get("model") or {}).get("vocab")
        keep = [t for t in added if t["id"] < vocab_size]
        if len(keep) != len(added) or (isinstance(vocab, dict) and max(vocab.values(), default=-1) >= vocab_size):
            data["added_tokens"] = keep
            if isinstance(vocab, dict):
                data["model"]["vocab"] = {k: v for k, v in vocab.items() if v < vocab_size}
            (dest / TOKENIZER_JSON).write_text(json.dumps(data, ensure_ascii=False))
            changed.append(TOKENIZER_JSON)
    tc = src / TOKENIZER_CONFIG
    if tc.is_file():
        cfg = json.loads(tc.read_text())
        decoder = cfg.get("added_tokens_decoder") or {}
        if any(int(i) >= vocab_size for i in decoder):
            cfg["added_tokens_decoder"] = {i: t for i, t in decoder.items() if int(i) < vocab_size}
            (dest / TOKENIZER_CONFIG).write_text(json.dumps(cfg, ensure_ascii=False, indent=2))
            changed.append(TOKENIZER_CONFIG)
    return changed


def ensure_gguf(lc: LlamaCpp, folder: Path, vocab_size: int, outtype: str,
                log: Callable[[str], None] = print) -> Path:
    """`folder` converted to GGUF at `outtype` (bf16, q8_0, q4_0, q4_1, q4_k_m), made on first use."""
    out_dir = bench_dir() / "gguf"
    out = out_dir / f"{folder.name}-{_folder_digest(folder)}-{lc.version}-{outtype}.gguf"
    if out.is_file():
        return out
    if outtype in FTYPES:
        return _quantized(lc, ensure_gguf(lc, folder, vocab_size, "bf16", log), out, outtype, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir / f".{out.name}.lock")):
        if out.is_file():
            return out
        log(f"[bench] converting {folder.name} to GGUF {outtype}")
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log_file = out.with_suffix(".log")
        try:
            changed = trim_tokenizer_files(folder, staging, vocab_size)
            for p in folder.iterdir():
                if p.is_file() and p.name not in changed:
                    (staging / p.name).symlink_to(p.resolve())
            env = dict(os.environ, PYTHONPATH=str(lc.converter_path))
            with open(log_file, "w") as lf:
                r = subprocess.run([sys.executable, str(lc.converter), str(staging), "--outfile", str(tmp),
                                    "--outtype", outtype], stdout=lf, stderr=subprocess.STDOUT, env=env)
            if r.returncode != 0:
                tail = log_file.read_text(errors="replace").splitlines()[-5:]
                raise BenchError(f"GGUF conversion of {folder} to {outtype} failed (exit {r.returncode}); "
                                 f"log {log_file}:\n  " + "\n  ".join(tail))
            os.replace(tmp, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            tmp.unlink(missing_ok=True)
    return out


def _quantized(lc: LlamaCpp, src: Path, out: Path, kind: str, log: Callable[[str], None]) -> Path:
    """`src` requantized to `kind` into `out` by llama.cpp's quantizer, in a child under its interpreter."""
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if out.is_file():
            return out
        log(f"[bench] quantizing {src.name} to {kind} with llama.cpp")
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log_file = out.with_suffix(".log")
        try:
            with open(log_file, "w") as lf:
                r = subprocess.run([str(lc.python), "-m", "bench.llamacpp_quantize", str(src), str(tmp), kind],
                                   stdout=lf, stderr=subprocess.STDOUT, env=child_env(), cwd=PROJECT_ROOT)
            if r.returncode != 0 or not tmp.is_file():
                tail = log_file.read_text(errors="replace").splitlines()[-5:]
                raise BenchError(f"llama.cpp could not quantize {src.name} to {kind} (exit {r.returncode}); "
                                 f"log {log_file}:\n  " + "\n  ".join(tail))
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out
