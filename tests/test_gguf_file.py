"""The GGUF reader against gguf-py's, on files gguf-py writes: every metadata value type, every
tensor type the runtime meets, a custom alignment; every way a file can be broken, in one line
each; and the import's values (`gguf.values`) against gguf-py's dequantization, bit for bit."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from llama_base.errors import CheckpointError
from llama_runtime.checkpoints.gguf.reader import GGUFFile
from llama_runtime.checkpoints.gguf.importer import smollm2_gguf_path


def _same_as_gguf_py(path) -> GGUFFile:
    from gguf import GGUFReader, GGUFValueType

    ours, theirs = GGUFFile(path), GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}   # the header, as fields
    assert set(ours.fields) | set(ours.counts) == set(fields)
    for name, field in fields.items():
        want = field.contents()
        if name in ours.counts:    # gguf-py flattens an array of arrays: only strings compare by length
            assert ours.counts[name] == len(want) or field.types[1] != GGUFValueType.STRING, name
        elif isinstance(ours.fields[name], np.ndarray):
            assert ours.fields[name].tolist() == want, name
        else:
            assert ours.fields[name] == want and type(ours.fields[name]) is type(want), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def _write(path, alignment: int | None = None):
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strings", ["a", "", "ç" * 40])
    w.add_array("t.nested", [[1, 2], [3]])
    cols = 256
    for name, kind in (("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1),
                       ("q8_0", T.Q8_0)):
        x = rng.standard_normal((7, cols)).astype(np.float32)
        data = x if kind == T.F32 else x.astype(np.float16) if kind == T.F16 else quantize(x, kind)
        w.add_tensor(f"{name}.weight", data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    for name, kind, block in (("q4_k", T.Q4_K, 144), ("q6_k", T.Q6_K, 210)):
        raw = rng.integers(0, 256, (7, 2, block), dtype=np.uint8)        # 7 rows of 2 super-blocks
        scales = (rng.random((7, 2, 2)) * 1e-2 - (kind == T.Q6_K) * 5e-3).astype(np.float16).view(np.uint8)
        if kind == T.Q4_K:
            raw[..., 0:4] = scales.reshape(7, 2, 4)                        # d and dmin: finite
        else:
            raw[..., 208:210] = scales[..., :2]                            # d: finite, either sign
        w.add_tensor(f"{name}.weight", raw.reshape(7, -1), raw_dtype=kind)
    w.add_tensor("vec.weight", rng.standard_normal(5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_the_embedded_models_file_as_gguf_py_does():
    ours = _same_as_gguf_py(smollm2_gguf_path())
    assert ours.counts["tokenizer.ggml.tokens"] == 49152 and ours.fields["llama.block_count"] == 30


@pytest.mark.parametrize("alignment", [None, 64])
def test_reads_every_value_and_tensor_type_as_gguf_py_does(tmp_path, alignment):
    ours = _same_as_gguf_py(_write(tmp_path / "all.gguf", alignment))
    assert ours.counts == {"t.strings": 3, "t.nested": 2}
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.u64"] == 2**64 - 1
    assert {t.name: t.shape for t in ours.tensors}["q4_k.weight"] == (7, 512)


def test_the_imports_values_equal_gguf_pys_dequantization_bit_for_bit(tmp_path, monkeypatch):
    """Chunks of 2 rows, so each tensor's 7 rows end in a part chunk."""
    import torch
    from gguf.quants import dequantize

    from llama_runtime.checkpoints.gguf import values

    monkeypatch.setattr(values, "_CHUNK_WEIGHTS", 600)
    ours = GGUFFile(_write(tmp_path / "all.gguf"))
    assert {t.tensor_type.name for t in ours.tensors} >= {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"}
    for t in ours.tensors:
        want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).to(torch.bfloat16)
        got = values.values_bf16(t)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16)), t.name


def test_every_broken_file_is_one_line(tmp_path):
    good = _write(tmp_path / "good.gguf", alignment=64).read_bytes()
    cases = {
        "empty": (b"", "cannot be mapped"),
        "junk": (b"not a model\n" * 4, "no GGUF magic"),
        "version 1": (good[:4] + struct.pack("<I", 1) + good[8:], "GGUF version 1"),
        "big-endian": (good[:4] + struct.pack(">I", 3) + good[8:], "GGUF version 50331648"),
        "cut in a string array": (good[:good.index(b"\xc3\xa7")], "cut short inside its header"),
        "cut in the tensor infos": (good[:good.index(b"q8_0.weight")], "cut short inside its header"),
        "alignment 0": (good.replace(b"general.alignment" + struct.pack("<II", 4, 64),
                                     b"general.alignment" + struct.pack("<II", 4, 0)), "general.alignment is 0"),
        "cut in the data": (good[:len(good) - 60], "cut short inside tensor 'vec.weight'"),   # 20 bytes, padded to 64
        "unknown tensor type": (good.replace(b"vec.weight" + struct.pack("<IQ", 1, 5) + struct.pack("<I", 0),
                                             b"vec.weight" + struct.pack("<IQ", 1, 5) + struct.pack("<I", 99)),
                                "unknown type 99"),
    }
    for label, (raw, why) in cases.items():
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(raw)
        with pytest.raises(CheckpointError) as e:
            GGUFFile(path)
            pytest.fail(label)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{path}: not a readable GGUF file") and why in msg, (label, msg)
