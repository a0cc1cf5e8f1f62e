"""The hardware rules (`kernel_builder.hw_rules`): each refuses what the NPU would, the
validator applies them to every module without running it, and every group of every model
the runtime supports keeps them."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY
from mlir_samples import CONFIGS, SEGS_DMA_WHOLE, resident_groups

from kernel_builder import backend_presets as presets
from kernel_builder import groups, hw_rules
from kernel_builder.hw_rules import CORE, L2, MEMTILE, SHIM
from kernel_builder.mlir.emit import Value, _fit_wraps
from llama_base.config import LLAMA_3_2_3B, LlamaConfig
from llama_runtime.checkpoints import builtin
from multi_launch_builder.compile import assemble, compile_group_mlir
from multi_launch_builder.mlir_validate import MlirValidationError, validate_group_module, validate_module



def side(space, item, offset, sizes, strides, nbytes=1 << 16):
    return hw_rules.dma_side_problems(space, item, offset, sizes, strides, nbytes)


@pytest.mark.parametrize("sizes,strides,offset,message", [
    ([1], [1], 0, "runs of 2 bytes"),                     # one bf16 element
    ([3], [1], 0, "runs of 6 bytes"),
    ([4], [1], 2, "byte offset 2"),                       # an odd bf16 element
    ([4, 2], [3, 1], 0, "steps 6 bytes"),                 # rows of an odd-length matrix
    ([8], [2], 0, "runs of 2 bytes"),                     # every other bf16 element
])
def test_a_dma_moves_whole_words_at_word_offsets(sizes, strides, offset, message):
    problems = side(hw_rules.L3, 2, offset, sizes, strides)
    assert problems and message in problems[0]
    assert not side(hw_rules.L3, 2, 4, [4, 2], [8, 1])


def test_wraps_strides_and_dimensions_depend_on_the_tile():
    # A strided run of 1024 bytes: a shim or memory tile wraps it (256 words), a compute tile cannot.
    for space in (hw_rules.L3, L2):
        assert not side(space, 1, 0, [2, 1024], [2048, 1])
    assert "wraps at most 255" in side(hw_rules.L1, 1, 0, [2, 1024], [2048, 1])[0]
    # A contiguous transfer is one linear run: no wrap applies, only the length field.
    assert not side(hw_rules.L1, 1, 0, [2, 1024], [1024, 1])
    assert "moves at most" in side(hw_rules.L1, 4, 0, [1 << CORE.linear_bits], [1], nbytes=1 << 20)[0]
    # Strides: a compute tile steps at most 2^13 words, a shim 2^20.
    far = (1 << CORE.stride_bits) + 1
    assert "steps at most" in side(hw_rules.L1, 4, 0, [2, 4], [far, 1])[0]
    assert not side(hw_rules.L3, 4, 0, [2, 4], [far, 1])
    assert "steps at most" in side(hw_rules.L3, 4, 0, [2, 4], [(1 << SHIM.stride_bits) + 1, 1])[0]
    # Dimensions: 3 on a compute tile, 4 on a memory tile; the shim's fourth is an iteration.
    four = ([2, 2, 2, 4], [64, 16, 8, 1])
    assert "at most 3" in side(hw_rules.L1, 4, 0, *four)[0]
    assert not side(L2, 4, 0, *four)
    assert not side(hw_rules.L3, 4, 0, *four)
    assert "iterates at most 64" in side(hw_rules.L3, 4, 0, [65, 2, 2, 4], [256, 64, 8, 1], nbytes=1 << 20)[0]
    assert "at most 4" in side(L2, 4, 0, [2, 2, 2, 2, 4], [512, 128, 64, 16, 1])[0]
    assert (CORE.bds, MEMTILE.bds, SHIM.bds) == (16, 48, 16)
    assert (CORE.locks, MEMTILE.locks, SHIM.locks) == (16, 64, 16)


def test_the_emitter_splits_a_run_too_long_for_the_wrap():
    l1 = Value("%t", "memref<2560xi8, 2 : i32>")
    offsets, sizes, strides = _fit_wraps(l1, ([0, 7], [2, 1024], [1280, 1]))
    assert (sizes, strides) == ([2, 2, 512], [1280, 512, 1]) and offsets[-1] == 7
    assert not side(hw_rules.L1, 1, 0, sizes, strides)
    assert _fit_wraps(l1, ([0, 0], [2, 1024], [1024, 1])) == ([0, 0], [2, 1024], [1024, 1])   # contiguous


def _herd_module(n: int, dmas: int = 1, loop: bool = False, buffers: int = 1) -> str:
    """One herd core copying an n-element bf16 buffer into each of `buffers` L1 buffers, `dmas`
    times each (inside a loop)."""
    l3, l1 = f"memref<{n}xbf16>", f"memref<{n}xbf16, 2 : i32>"
    bufs = [f"%buf{i}" for i in range(buffers)]
    body = "\n".join(f'"air.dma_memcpy_nd"({b}, %h0) {{{SEGS_DMA_WHOLE}}} : ({l1}, {l3}) -> ()'
                     for b in bufs for _ in range(dmas))
    if loop:
        body = f"%c0 = arith.constant 0 : index\n%c2 = arith.constant 2 : index\nscf.for %i = %c0 to %c2 step %one {{\n{body}\n}}"
    allocs = "\n".join(f"{b} = memref.alloc() : {l1}" for b in bufs)
    deallocs = "\n".join(f"memref.dealloc {b} : {l1}" for b in bufs)
    return f"""module {{
  func.func @f(%arg0: {l3}) {{
    "air.launch"(%arg0) ({{
    ^bb0(%l0: {l3}):
      "air.segment"(%l0) ({{
      ^bb0(%s0: {l3}):
        %c1 = arith.constant 1 : index
        "air.herd"(%c1, %c1, %s0) ({{
        ^bb0(%tx: index, %ty: index, %sx: index, %sy: index, %h0: {l3}):
          %one = arith.constant 1 : index
          {allocs}
          {body}
          {deallocs}
          "air.herd_terminator"() : () -> ()
        }}) {{operandSegmentSizes = array<i32: 0, 2, 1>, sym_name = "herd"}} : (index, index, {l3}) -> ()
        "air.segment_terminator"() : () -> ()
      }}) {{operandSegmentSizes = array<i32: 0, 0, 1>, sym_name = "seg"}} : ({l3}) -> ()
      "air.launch_terminator"() : () -> ()
    }}) {{operandSegmentSizes = array<i32: 0, 0, 1>, sym_name = "launch"}} : ({l3}) -> ()
    return
  }}
}}
"""


def test_the_validator_counts_l1_with_double_buffers_and_descriptors():
    validate_module(_herd_module(16384))          # 32 KiB: fits once
    with pytest.raises(MlirValidationError, match=r"launch launch, herd herd, air.herd \(line \d+\): core holds "
                                                  r"65536 bytes of L1 \(double buffers counted twice\)"):
        validate_module(_herd_module(16384, loop=True))
    validate_module(_herd_module(64, dmas=CORE.bds))
    with pytest.raises(MlirValidationError, match=r"each core needs at least 17 buffer descriptors.*has 16"):
        validate_module(_herd_module(64, dmas=CORE.bds + 1))


def test_the_validator_counts_a_pair_of_locks_per_buffer_a_core_moves():
    """Many descriptors on one buffer share its pair; each further buffer takes a pair of its own."""
    pairs = CORE.locks // hw_rules.LOCKS_PER_BUFFER
    validate_module(_herd_module(64, buffers=pairs, dmas=2))
    with pytest.raises(MlirValidationError, match=rf"launch launch, herd herd, air.herd \(line \d+\): each core needs "
                                                  rf"at least {CORE.locks + 2} locks \(a pair for each of {pairs + 1} "
                                                  rf"buffers its DMAs move\); a compute tile has {CORE.locks}"):
        validate_module(_herd_module(64, buffers=pairs + 1))


def _down(cfg, **params):
    """The decode FFN group with its down projection's tiling replaced."""
    g = groups.build_group("o_gemv_ffn", cfg)
    launches = tuple(dataclasses.replace(l, params=tuple(sorted({**l.param_dict, **params}.items())))
                     if l.name == "down_proj" else l for l in g.launches)
    return dataclasses.replace(g, launches=launches)


def test_one_output_row_per_core_is_refused_without_running_anything():
    """Llama-3.2-1B's down projection with the tiling it once had (one output row per core,
    full K): 2-byte output DMAs at odd element offsets, which the NPU lowering rejects."""
    cfg = CONFIGS["llama32_1b"]
    g = _down(cfg, tile_m=1, tile_k=cfg.intermediate_size)
    with pytest.raises(MlirValidationError) as e:
        validate_group_module(assemble(g), g)
    text = str(e.value)
    assert "o_gemv_ffn: launch down_proj_launch, herd down_proj_herd, air.dma_memcpy_nd" in text
    assert "destination (shim tile): starts at byte offsets known only to be multiples of 2" in text
    assert "moves contiguous runs of 2 bytes" in text


@pytest.mark.parametrize("name", ["llama32_1b", "llama32_3b", "smollm2", "tiny_tests"])
def test_every_gemv_moves_whole_words_and_fits_l1(name):
    cfg = {**CONFIGS, "llama32_3b": LLAMA_3_2_3B, "tiny_tests": TINY}[name]
    for kind in ("rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"):
        for l in groups.build_group(kind, cfg).launches:
            if l.op != "gemv":
                continue
            p = l.param_dict
            assert p["tile_m"] * presets.BF16 % hw_rules.WORD == 0, (name, l.name)
            assert presets.gemv_l1_bytes(p["tile_m"], p["K"], p["tile_k"]) <= presets.L1_BUDGET
            assert p["K"] % p["tile_k"] == 0 and p["tile_k"] * presets.BF16 <= SHIM.max_wrap * hw_rules.WORD \
                or p["tile_k"] == p["K"]
    if name in ("llama32_1b", "llama32_3b"):
        down = next(l for l in groups.build_group("o_gemv_ffn", cfg).launches if l.name == "down_proj").param_dict
        assert down["tile_k"] < down["K"] and down["tile_m"] >= 2


@pytest.mark.parametrize("quant", ["bf16", "q4nx"])
@pytest.mark.parametrize("name", ["llama32_1b", "llama32_3b", "smollm2", "tiny_model"])
def test_every_group_of_every_model_breaks_no_rule(name, quant):
    """The validation `make compile` runs includes the rules: every group at the smallest and
    largest bucket, both weight formats."""
    cfg = {**CONFIGS, "llama32_3b": LLAMA_3_2_3B}.get(name) or builtin.tiny_config(builtin.ensure_embedded_model())
    buckets = groups.prefill_buckets(cfg, 2048)
    for g in groups.all_groups(cfg, (buckets[0], buckets[-1]), quant=quant):
        compile_group_mlir(g)
    for g in resident_groups(cfg, quant):
        compile_group_mlir(g)


def test_a_unit_dimension_s_stride_is_never_applied_so_it_breaks_no_rule():
    """A K/V tile of head h is [1, tile, d] at stride ctx·d: at 133120 positions of head size
    64 that stride is 2^23 words, past every DMA's stride field, but a dimension of size 1 is
    never stepped (mlir-aie encodes no stride for it). The same stride on a dimension of
    size 2 is refused."""
    ctx, d, t = 131072 + 2048, 64, 64
    assert ctx * d * presets.BF16 // hw_rules.WORD > 1 << SHIM.stride_bits
    assert not side(hw_rules.L3, 2, 3 * ctx * d * 2, [1, t, d], [ctx * d, d, 1], 8 * ctx * d * 2)
    assert "steps" in " ".join(side(hw_rules.L3, 2, 0, [2, t, d], [ctx * d, d, 1], 8 * ctx * d * 2))


@pytest.mark.parametrize("name", ["llama32_1b", "llama32_3b"])
def test_the_resident_groups_keep_the_rules_at_the_whole_context(name):
    """The 1B and 3B caches at their 131072 positions plus a 2048-row prefill chunk's room:
    the decode attention's and the prefill attention's K/V DMAs, and the KV append's, at the
    largest head offsets."""
    cfg = {**CONFIGS, "llama32_3b": LLAMA_3_2_3B}[name]
    from kernel_builder.fused_groups import cache_capacity

    capacity = cache_capacity(cfg, 131072, 2048)
    assert capacity >= 131072 + 2047
    for g in resident_groups(cfg, capacity=capacity):
        compile_group_mlir(g)
