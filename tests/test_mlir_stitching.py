"""The stitcher: prefixing, argument remapping, wrapping, extern merging, and its hard errors."""
from __future__ import annotations

import re

import pytest
from mlir_samples import BARE_HERD, GOOD, L1, L3, SMOLLM2

from kernel_builder import groups
from kernel_builder.mlir import build_launch
from multi_launch_builder.mlir_validate import MlirValidationError, validate_module
from multi_launch_builder.stitching import Part, StitchError, stitch, stitch_group

TWO = [L3, L3]


def test_two_parts_become_one_function_with_prefixed_names():
    text = stitch("both", [L3, L3, L3], [Part("p", GOOD, (0, 1)), Part("q", GOOD, (1, 2))])
    s = validate_module(text)
    assert s.func_name == "both"
    assert [(u.name, u.args, u.reads, u.writes) for u in s.launches] == [
        ("p_launch", (0, 1), {0}, {1}), ("q_launch", (1, 2), {1}, {2})]
    assert "%p_buf" in text and "%q_buf" in text and '"p_herd"' in text and '"q_segment"' in text
    # the external kernel keeps its name and is declared once
    assert text.count("func.func private @k(") == 1
    assert "func.call @k(%p_buf, %p_out)" in text


def test_a_bare_herd_is_wrapped_in_launch_and_segment():
    with pytest.raises(MlirValidationError, match="must be nested directly in air.segment"):
        validate_module(BARE_HERD)
    text = stitch("wrapped", TWO, [Part("w", BARE_HERD, (0, 1))])
    s = validate_module(text)
    assert [(u.args, u.reads, u.writes, u.herds) for u in s.launches] == [((0, 1), {0}, {1}, ((2, 2),))]
    assert '"w_copy"' in text and '"w_launch"' in text and '"w_segment"' in text
    assert re.search(r"^#w_map = affine_map<\(d0\) -> \(d0\)>$", text, re.M)
    assert "#map" not in text.replace("#w_map", "")


def test_parts_sharing_a_prefix_collide():
    with pytest.raises(StitchError, match="colliding names"):
        stitch("f", TWO, [Part("a", GOOD, (0, 1)), Part("a", GOOD, (0, 1))])


def test_prefixes_that_produce_the_same_name_collide():
    # part "a" holds %b_buf -> %a_b_buf; part "a_b" holds %buf -> %a_b_buf
    renamed = GOOD.replace("%buf", "%b_buf")
    with pytest.raises(StitchError, match="colliding names: %a_b_buf"):
        stitch("f", TWO, [Part("a", renamed, (0, 1)), Part("a_b", GOOD, (0, 1))])


def test_an_argument_without_destination_is_an_error():
    with pytest.raises(StitchError, match="%arg1 lands nowhere"):
        stitch("f", [L3], [Part("p", GOOD, (0,))])


def test_an_unused_argument_is_an_error():
    unused = GOOD.replace("func.func @f(%arg0: memref<64xbf16>, %arg1: memref<64xbf16>)",
                          "func.func @f(%arg0: memref<64xbf16>, %arg1: memref<64xbf16>, %extra: memref<64xbf16>)")
    with pytest.raises(StitchError, match="%extra lands nowhere"):
        stitch("f", [L3, L3, L3], [Part("p", unused, (0, 1, 2))])


def test_an_out_of_range_slot_is_an_error():
    with pytest.raises(StitchError, match="maps to slot 2, out of range"):
        stitch("f", TWO, [Part("p", GOOD, (0, 2))])


def test_an_unreferenced_combined_argument_is_an_error():
    with pytest.raises(StitchError, match=r"combined argument\(s\) \[2\] are referenced by no part"):
        stitch("f", [L3, L3, L3], [Part("p", GOOD, (0, 1))])


def test_argument_types_must_match_the_slot():
    with pytest.raises(StitchError, match="is memref<64xbf16> but combined argument 1 is memref<32xbf16>"):
        stitch("f", [L3, "memref<32xbf16>"], [Part("p", GOOD, (0, 1))])


def test_an_undefined_symbol_is_an_error():
    bad = GOOD.replace("func.func private @k(", "func.func private @kk(")
    with pytest.raises(StitchError, match="@k is neither defined in the part nor declared external"):
        stitch("f", TWO, [Part("p", bad, (0, 1))])


def test_external_declarations_merge_or_conflict():
    no_link = GOOD.replace('link_with = "k.o", ', "")
    merged = stitch("f", [L3, L3, L3], [Part("p", no_link, (0, 1)), Part("q", GOOD, (1, 2))])
    assert merged.count("func.func private @k(") == 1 and 'link_with = "k.o"' in merged
    other_obj = GOOD.replace('"k.o"', '"other.o"')
    with pytest.raises(StitchError, match="links other.o, elsewhere k.o"):
        stitch("f", [L3, L3, L3], [Part("p", GOOD, (0, 1)), Part("q", other_obj, (1, 2))])
    other_type = GOOD.replace(f"func.func private @k({L1}, {L1})", f"func.func private @k({L1}, {L1}, i32)")
    with pytest.raises(StitchError, match="@k declared as"):
        stitch("f", [L3, L3, L3], [Part("p", GOOD, (0, 1)), Part("q", other_type, (1, 2))])


def test_pretty_form_air_ops_are_refused():
    pretty = f"""module {{
  func.func @p(%a: {L3}) {{
    %c1 = arith.constant 1 : index
    air.herd tile (%x, %y) in (%sx=%c1, %sy=%c1) args(%q=%a) : {L3} {{
    }}
    return
  }}
}}"""
    with pytest.raises(StitchError, match="generic form"):
        stitch("f", [L3], [Part("p", pretty, (0,))])


def test_stitch_group_maps_arguments_from_the_declaration():
    g = groups.o_gemv_ffn(SMOLLM2)
    texts = [build_launch(g, l) for l in g.launches]
    text = stitch_group(g, texts)
    s = validate_module(text)
    for use, launch in zip(s.launches, g.launches):
        assert use.name == f"{launch.name}_launch"
        assert use.args == tuple(g.index(a) for a in launch.args)
    # gate and up projections call the same GEMV symbol: declared once
    decls = re.findall(r"func\.func private @(\w+)\(", text)
    assert len(decls) == len(set(decls))
    with pytest.raises(StitchError, match="7 modules for 8 launches"):
        stitch_group(g, texts[:-1])
