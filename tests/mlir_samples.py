"""Shapes and hand-written modules shared by the MLIR tests.

`GOOD` is a minimal, correct single-launch module (one herd copying a buffer through an
external kernel); the tests break it one way at a time with `str.replace`, so each bad module
differs from a good one by exactly the fault under test.
"""
from __future__ import annotations

from kernel_builder.fused_groups import cache_capacity, decode_windows, fused_decode, resident_flash_attn, window_for
from llama_base.config import LlamaConfig

SMOLLM2 = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                      rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True)
CONFIGS = {"llama32_1b": LlamaConfig(), "smollm2": SMOLLM2}
BUCKET = 128


def resident_groups(cfg: LlamaConfig, quant: str = "bf16", capacity: int | None = None,
                    small_window: bool = False) -> list:
    """The resident-KV groups of a model: prefill attention appending a bucket to the cache and
    the fused decode over the whole cache (and, with `small_window`, in the staircase's
    smallest window, a module that differs in its decode attention's transfers only)."""
    cap = capacity or cache_capacity(cfg, 4 * BUCKET, BUCKET)
    small = [fused_decode(cfg, cap, quant, window=decode_windows(cap)[0])] if small_window else []
    return [resident_flash_attn(cfg, BUCKET, cap, window_for(BUCKET, cap)), fused_decode(cfg, cap, quant), *small]

SEGS_DMA_WHOLE = "operandSegmentSizes = array<i32: 0, 1, 0, 0, 0, 1, 0, 0, 0>"
L3 = "memref<64xbf16>"
L1 = "memref<64xbf16, 2 : i32>"

GOOD = f"""
module {{
  func.func @f(%arg0: {L3}, %arg1: {L3}) {{
    "air.launch"(%arg0, %arg1) ({{
    ^bb0(%l0: {L3}, %l1: {L3}):
      "air.segment"(%l0, %l1) ({{
      ^bb0(%s0: {L3}, %s1: {L3}):
        %c1 = arith.constant 1 : index
        "air.herd"(%c1, %c1, %s0, %s1) ({{
        ^bb0(%tx: index, %ty: index, %sx: index, %sy: index, %h0: {L3}, %h1: {L3}):
          %buf = memref.alloc() : {L1}
          %out = memref.alloc() : {L1}
          "air.dma_memcpy_nd"(%buf, %h0) {{{SEGS_DMA_WHOLE}}} : ({L1}, {L3}) -> ()
          func.call @k(%buf, %out) : ({L1}, {L1}) -> ()
          "air.dma_memcpy_nd"(%h1, %out) {{{SEGS_DMA_WHOLE}}} : ({L3}, {L1}) -> ()
          memref.dealloc %buf : {L1}
          memref.dealloc %out : {L1}
          "air.herd_terminator"() : () -> ()
        }}) {{operandSegmentSizes = array<i32: 0, 2, 2>, sym_name = "herd"}} : (index, index, {L3}, {L3}) -> ()
        "air.segment_terminator"() : () -> ()
      }}) {{operandSegmentSizes = array<i32: 0, 0, 2>, sym_name = "segment"}} : ({L3}, {L3}) -> ()
      "air.launch_terminator"() : () -> ()
    }}) {{operandSegmentSizes = array<i32: 0, 0, 2>, sym_name = "launch"}} : ({L3}, {L3}) -> ()
    return
  }}
  func.func private @k({L1}, {L1}) attributes {{link_with = "k.o", llvm.emit_c_interface}}
}}
"""

# The same computation written as a bare herd: the stitcher must wrap it.
BARE_HERD = f"""
#map = affine_map<(d0) -> (d0)>
module {{
  func.func @g(%a: {L3}, %b: {L3}) {{
    %c2 = arith.constant 2 : index
    "air.herd"(%c2, %c2, %a, %b) ({{
    ^bb0(%tx: index, %ty: index, %sx: index, %sy: index, %x: {L3}, %y: {L3}):
      %buf = memref.alloc() : {L1}
      %out = memref.alloc() : {L1}
      "air.dma_memcpy_nd"(%buf, %x) {{{SEGS_DMA_WHOLE}}} : ({L1}, {L3}) -> ()
      linalg.generic {{indexing_maps = [#map, #map], iterator_types = ["parallel"]}}
          ins(%buf : {L1}) outs(%out : {L1}) {{
      ^bb0(%in: bf16, %o: bf16):
        linalg.yield %in : bf16
      }}
      "air.dma_memcpy_nd"(%y, %out) {{{SEGS_DMA_WHOLE}}} : ({L3}, {L1}) -> ()
      "air.herd_terminator"() : () -> ()
    }}) {{operandSegmentSizes = array<i32: 0, 2, 2>, sym_name = "copy"}} : (index, index, {L3}, {L3}) -> ()
    return
  }}
}}
"""
