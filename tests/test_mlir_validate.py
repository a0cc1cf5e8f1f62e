"""The validator catches what MLIR's parser accepts in unregistered AIR regions."""
from __future__ import annotations

import pytest
from mlir_samples import GOOD, L1, L3, SEGS_DMA_WHOLE, SMOLLM2

from kernel_builder import groups
from kernel_builder.mlir import build_launch
from multi_launch_builder.compile import assemble
from multi_launch_builder.mlir_validate import MlirValidationError, cross_check, rewrite_calls, validate_module
from multi_launch_builder.stitching import Part, slot_types, stitch


def problems(text: str) -> str:
    with pytest.raises(MlirValidationError) as e:
        validate_module(text)
    return "\n".join(e.value.problems)


def test_good_module_passes_and_is_summarised():
    s = validate_module(GOOD)
    assert s.func_name == "f"
    assert s.arg_types == (L3, L3)
    assert len(s.launches) == 1
    use = s.launches[0]
    assert (use.args, use.reads, use.writes, use.herds) == ((0, 1), {0}, {1}, ((1, 1),))
    assert s.externs == {"k": "k.o"}


def test_calls_are_rewritten_so_the_parser_accepts_them():
    text = rewrite_calls(GOOD)
    assert "func.call" not in text
    assert '"mlir_validate.call"(%buf, %out) {callee = @k}' in text
    assert text.count("\n") == GOOD.count("\n")  # diagnostics keep their line numbers


def test_use_before_def_inside_a_herd():
    bad = GOOD.replace(
        "          %buf = memref.alloc() : " + L1 + "\n",
        "          %early = memref.load %buf[%c0h] : " + L1 + "\n"
        "          %c0h = arith.constant 0 : index\n"
        "          %buf = memref.alloc() : " + L1 + "\n")
    assert "before its definition" in problems(bad)


def test_herd_must_not_capture_outer_values():
    call = "func.call @k(%buf, %out)"
    bad = GOOD.replace(call, "%z = arith.addi %c1, %c1 : index\n          " + call)
    assert "isolated from above" in problems(bad)


def test_operand_segment_sizes_must_cover_the_operands():
    bad = GOOD.replace("array<i32: 0, 2, 2>", "array<i32: 0, 2, 1>")
    assert "add up to 3, op has 4 operands" in problems(bad)


def test_segment_sizes_in_properties_are_read_too():
    segs = "operandSegmentSizes = array<i32: 0, 2, 2>"
    text = GOOD.replace('"air.herd"(%c1, %c1, %s0, %s1) ({', '"air.herd"(%c1, %c1, %s0, %s1) <{' + segs + '}> ({')
    text = text.replace("{" + segs + ', sym_name = "herd"}', '{sym_name = "herd"}')
    assert validate_module(text).launches[0].herds == ((1, 1),)
    bad = text.replace("<{" + segs, "<{operandSegmentSizes = array<i32: 0, 1, 2>")
    assert "add up to 3" in problems(bad)


def test_call_types_and_declarations_are_checked():
    assert "declared (memref" in problems(GOOD.replace(
        "func.func private @k(" + L1 + ", " + L1 + ")", "func.func private @k(" + L1 + ")"))
    undeclared = GOOD.replace("func.call @k(", "func.call @nowhere(")
    text = problems(undeclared)
    assert "no func.func private declares" in text and "@k is declared but never called" in text
    assert "has no link_with" in problems(GOOD.replace('link_with = "k.o", ', ""))


def test_cores_touch_only_l1():
    out = "%out = memref.alloc() : " + L1
    l2_alloc = GOOD.replace(out, out + "\n          %l2 = memref.alloc() : memref<64xbf16, 1 : i32>")
    assert "allocation in a herd must be L1" in problems(l2_alloc)
    l3_to_kernel = GOOD.replace(f"func.call @k(%buf, %out) : ({L1}, {L1})", f"func.call @k(%h0, %out) : ({L3}, {L1})")
    l3_to_kernel = l3_to_kernel.replace(f"func.func private @k({L1}, ", f"func.func private @k({L3}, ")
    assert "kernels take L1 buffers" in problems(l3_to_kernel)
    call = "func.call @k(%buf, %out)"
    l3_compute = GOOD.replace(call, f"%v = memref.load %h0[%tx] : {L3}\n          " + call)
    assert "a core can only touch L1 directly" in problems(l3_compute)


def test_hierarchy_nesting_and_terminators():
    no_terminator = GOOD.replace('          "air.herd_terminator"() : () -> ()\n', "")
    assert "must end in air.herd_terminator" in problems(no_terminator)
    wrong_sizes = GOOD.replace("^bb0(%tx: index, %ty: index, %sx: index, %sy: index, ", "^bb0(%tx: index, %ty: index, ")
    assert "body has 4 arguments" in problems(wrong_sizes)
    swapped = GOOD.replace('sym_name = "segment"', 'sym_name = "herd"')
    assert "already used" in problems(swapped)


def test_herd_sizes_must_be_constants():
    bad = GOOD.replace('"air.herd"(%c1, %c1,', '%n = arith.addi %c1, %c1 : index\n        "air.herd"(%n, %c1,')
    assert "herd sizes must be arith.constant" in problems(bad)


def test_dma_patterns_are_consistent():
    bad = GOOD.replace(f'"air.dma_memcpy_nd"(%buf, %h0) {{{SEGS_DMA_WHOLE}}}',
                       '%c0d = arith.constant 0 : index\n          %c64d = arith.constant 64 : index\n'
                       '          "air.dma_memcpy_nd"(%buf, %h0, %c0d, %c64d) {operandSegmentSizes = '
                       'array<i32: 0, 1, 0, 0, 0, 1, 1, 1, 0>}')
    bad = bad.replace("({L1}, {L3}) -> ()".format(L1=L1, L3=L3), f"({L1}, {L3}, index, index) -> ()", 1)
    assert "src offsets/sizes/strides have ranks [1, 1, 0]" in problems(bad)


CHANNELS = """
  "air.channel"() {sym_name = "chan", size = [1, 1]} : () -> ()"""


def test_channels_must_be_declared_and_have_both_ends():
    put = (f'"air.channel.put"(%h0) {{chan_name = @chan, operandSegmentSizes = array<i32: 0, 0, 1, 0, 0, 0>}}'
           f' : ({L3}) -> ()\n          func.call @k(')
    undeclared = GOOD.replace("func.call @k(", put)
    assert "channel @chan is not declared" in problems(undeclared)
    one_ended = undeclared.replace("module {", "module {" + CHANNELS)
    assert "has only ['air.channel.put']" in problems(one_ended)


def test_parse_errors_are_reported():
    assert "parse/verify" in problems(GOOD.replace("arith.constant 1 : index", "arith.constant 1 : i32"))


def test_cross_check_catches_a_stitch_that_swaps_same_typed_arguments():
    g = groups.lm_head_gemv(SMOLLM2)
    texts = [build_launch(g, l) for l in g.launches]
    maps = [tuple(g.index(a) for a in l.args) for l in g.launches]
    maps[0], maps[1] = maps[1], maps[0]  # partition 0 now reads w_p1 and writes logits_p1
    text = stitch(g.name, slot_types(g), [Part(l.name, t, m) for l, t, m in zip(g.launches, texts, maps)])
    summary = validate_module(text)  # structurally fine ...
    with pytest.raises(MlirValidationError, match="gemv_p0_launch takes arguments"):
        cross_check(summary, g)       # ... but not what the declaration says


def test_cross_check_compares_herds_with_the_declaration():
    g = groups.rms_gemv_rope(SMOLLM2)
    text = assemble(g)
    summary = validate_module(text)
    cross_check(summary, g)
    assert summary.launches[-1].herds == (tuple(g.launches[-1].p("herd")),)
    size_const = "%rope_k_c1 = arith.constant 1 : index"   # the segment's herd-size constant
    assert text.count(size_const) == 1
    wider = text.replace(size_const, size_const.replace("constant 1", "constant 2"))
    with pytest.raises(MlirValidationError, match=r"runs herds \[\(2, 2\)\]"):
        cross_check(validate_module(wider), g)


def test_cross_check_holds_the_resident_state_to_its_declared_writers():
    """The KV append is the only launch of resident prefill attention that writes the caches:
    its V rows redirected into the K cache leave the V cache unwritten by the launch that
    declares it, which the cross-check refuses."""
    from kernel_builder.fused_groups import resident_flash_attn

    g = resident_flash_attn(SMOLLM2, 64, 256)
    text = assemble(g)
    cross_check(validate_module(text), g)
    into_k = text.replace('"air.dma_memcpy_nd"(%kv_append_v_cache_2,', '"air.dma_memcpy_nd"(%kv_append_k_cache_2,', 1)
    assert into_k != text
    with pytest.raises(MlirValidationError, match=r"kv_append_launch reads .* / writes \[\d+\], kv_append declares"):
        cross_check(validate_module(into_k), g)
