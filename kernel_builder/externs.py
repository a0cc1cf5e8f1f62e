"""The contract between the MLIR builders and the hand-written C++ kernels.

Every external kernel a builder calls is described here once: its symbol, the C++ source it
comes from, the object file named in `link_with`, the `-D` defines that specialise the source
into that symbol, and the MLIR types of its arguments. The builders emit their
`func.func private` declarations from these entries and `external_kernels.py` compiles the
objects from them, so the two cannot drift apart (a test also parses the `.cc` signatures).

A herd names one object in its `link_with`, so every symbol one herd calls lives in one
object: a kernel whose herd calls several primitives (attention) shares a `link_object`
with its siblings, and the object build bundles their translation units into it.

Memref types carry static tile shapes, so one source is compiled into several symbols (for
example the GEMV once per (rows, K) pair: the down projection's K=ffn variant is its own
symbol, which is what lets both variants live in one stitched module). All buffers live in
L1 (memory space 2). Scalars are i32. Arithmetic is bf16 in, f32 accumulate, bf16 out; a
quantized weight arrives as its bytes (i8 memrefs, read as unsigned by the kernels).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llama_base import q4nx

if TYPE_CHECKING:
    from llama_base.group_contract import Launch

L1 = 2


def memref(shape: tuple[int, ...], dtype: str = "bf16", space: int = L1) -> str:
    return f"memref<{'x'.join(str(d) for d in shape)}x{dtype}, {space} : i32>"


@dataclass(frozen=True)
class ExternKernel:
    symbol: str
    source: str                                # file under kernel_builder/kernels/
    arg_types: tuple[str, ...]                 # MLIR argument types, in call order
    defines: tuple[tuple[str, int | str], ...]
    bundle: str | None = None                  # the shared object's stem, when one herd calls several
    # Buffer arguments the kernel reads (their contents on entry matter) and writes. A test
    # checks them against the C signature's `const`; the MLIR interpreter checks every read
    # argument was written first.
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()

    @property
    def obj(self) -> str:
        """This symbol's own translation unit's object (each symbol is its own specialisation)."""
        return f"{self.symbol}.o"

    @property
    def link_object(self) -> str:
        """The object `link_with` names: the bundle the symbol's herd links, else its own object.

        aiecc links what a herd's `link_with` names into that herd's cores; linking from
        function declarations alone needs a recent aiecc, so a herd's callees must share one.
        """
        return f"{self.bundle}.o" if self.bundle else self.obj

    def declaration(self) -> str:
        """The `func.func private` line a builder emits for this kernel."""
        args = ", ".join(self.arg_types)
        return (f'func.func private @{self.symbol}({args}) '
                f'attributes {{link_with = "{self.link_object}", llvm.emit_c_interface}}')


def gemv(tile_m: int, k: int, tile_k: int | None = None) -> ExternKernel:
    """y[tile_m] = W[tile_m, k] · x[k]: one L1 tile of output rows, full K, f32 accumulation.

    With `tile_k` < k the rows take K a tile at a time: acc[tile_m] (f32, in L1 across the
    tiles) += W[tile_m, tile_k] · x[col0 : col0 + tile_k], which lets a long K (the down
    projection's) keep several output rows per core, so the output moves whole 32-bit words."""
    if tile_k is not None and tile_k < k:
        sym = f"gemv_bf16_acc_m{tile_m}_t{tile_k}_k{k}"
        return ExternKernel(
            sym, "gemv_bf16.cc",
            (memref((tile_m, tile_k)), memref((k,)), memref((tile_m,), "f32"), "i32"),
            (("GEMV_TILE_M", tile_m), ("GEMV_TILE_K", tile_k), ("GEMV_K", k), ("GEMV_SYMBOL", sym)),
            reads=(0, 1, 2), writes=(2,),
        )
    return ExternKernel(
        f"gemv_bf16_m{tile_m}_k{k}", "gemv_bf16.cc",
        (memref((tile_m, k)), memref((k,)), memref((tile_m,))),
        (("GEMV_TILE_M", tile_m), ("GEMV_K", k), ("GEMV_SYMBOL", f"gemv_bf16_m{tile_m}_k{k}")),
        reads=(0, 1), writes=(2,),
    )


def q4nx_defines() -> tuple[tuple[str, int], ...]:
    """The Q4NX format's numbers, handed to every kernel that reads its bytes, so the C++ sources
    state none of their own."""
    return (("Q4NX_ROWS", q4nx.ROWS), ("Q4NX_COLS", q4nx.COLS), ("Q4NX_GROUP", q4nx.GROUP),
            ("Q4NX_FIXED_BITS", q4nx.FIXED_BITS))


def gemv_q4nx(tile_k: int, k: int) -> ExternKernel:
    """acc[ROWS] += W_block · x[col0 : col0 + cols] for one Q4NX block of one row-block (FusedDQP).

    The block buffer holds up to `tile_k` columns (`q4nx.BYTES_PER_COL` bytes each); `cols` says
    how many this block has (a row's last block may be narrower) and `col0` where its columns
    start in x. The f32 accumulator stays in L1 across the blocks of a row-block. The symbol
    carries K because x's memref type does.
    """
    sym = f"gemv_q4nx_t{tile_k}_k{k}"
    return ExternKernel(
        sym, "gemv_q4nx.cc",
        (memref((q4nx.BYTES_PER_COL * tile_k,), "i8"), memref((k,)), memref((q4nx.ROWS,), "f32"), "i32", "i32"),
        q4nx_defines() + (("GEMV_Q4NX_TILE_K", tile_k), ("GEMV_Q4NX_K", k), ("GEMV_Q4NX_SYMBOL", sym)),
        reads=(0, 1, 2), writes=(2,),
    )


def dequant_q4nx(rows: int, cols: int) -> ExternKernel:
    """W[rows, cols] in bf16 from the Q4NX bytes of that tile (itself a Q4NX matrix), bit-exact
    with `q4nx.dequantize`: prefill's GEMM multiplies these."""
    sym = f"dequant_q4nx_n{rows}_k{cols}"
    return ExternKernel(
        sym, "dequant_q4nx.cc",
        (memref((q4nx.nbytes(rows, cols),), "i8"), memref((rows, cols))),
        q4nx_defines() + (("DEQUANT_Q4NX_ROWS", rows), ("DEQUANT_Q4NX_COLS", cols), ("DEQUANT_Q4NX_SYMBOL", sym)),
        reads=(0,), writes=(1,),
    )


def rope(head_dim: int) -> ExternKernel:
    """One head-row of one position, half-split: y[i] = x[i]c - x[i+h]s, y[i+h] = x[i+h]c + x[i]s.

    `lut` is that position's table row: cos in [0, h), sin in [h, 2h), h = head_dim / 2.
    """
    return ExternKernel(
        f"rope_halfsplit_bf16_d{head_dim}", "rope_halfsplit.cc",
        (memref((head_dim,)), memref((head_dim,)), memref((head_dim,))),
        (("ROPE_HEAD_DIM", head_dim), ("ROPE_SYMBOL", f"rope_halfsplit_bf16_d{head_dim}")),
        reads=(0, 1), writes=(2,),
    )


def silu_and_mul(tile: int) -> ExternKernel:
    """out = SiLU(gate) * up over one tile, SiLU evaluated in f32."""
    return ExternKernel(
        f"silu_and_mul_bf16_n{tile}", "silu_and_mul.cc",
        (memref((tile,)), memref((tile,)), memref((tile,))),
        (("SWIGLU_TILE", tile), ("SWIGLU_SYMBOL", f"silu_and_mul_bf16_n{tile}")),
        reads=(0, 1), writes=(2,),
    )


def attention(head_dim: int, tile_q: int, tile_k: int | None = None, row_step: int = 1) -> list[ExternKernel]:
    """The flash-attention tile primitives for one shape, in call order.

    For a tile of `tile_q` query rows of one head: init running max/sum/accumulator; then for
    each key/value tile of `tile_k` positions (`tile_q` when not given): scores = q·kᵀ/√d
    (`qk`), causal mask by absolute positions (`mask`, skipped for tiles wholly in the past),
    online-softmax update producing bf16 probabilities and the rescale factor of the old
    accumulator (`softmax`), acc = acc·corr + p·v (`pv`); finally o = acc / sum (`finalize`).
    Query row i sits at position q_pos0 + i·`row_step`: 1 for a prefill tile of consecutive
    tokens, 0 for decode's rows (one token's query heads, all at its position).

    All six are called from the one attention herd, so they share the object `attn_{tag}.o`;
    prefill's square tiles keep the tag `d{d}_t{t}`.
    """
    d, tq = head_dim, tile_q
    tk = tile_q if tile_k is None else tile_k
    tag = f"d{d}_t{tq}" if tq == tk and row_step == 1 else f"d{d}_q{tq}_k{tk}_r{row_step}"

    def k(name: str, args: tuple[str, ...], reads: tuple[int, ...], writes: tuple[int, ...]) -> ExternKernel:
        sym = f"attn_{name}_{tag}"
        return ExternKernel(sym, "attention.cc", args,
                            (("ATTN_HEAD_DIM", d), ("ATTN_TILE_Q", tq), ("ATTN_TILE_K", tk), ("ATTN_ROW_STEP", row_step),
                             ("ATTN_ONLY", name), ("ATTN_SYMBOL", sym)),
                            bundle=f"attn_{tag}", reads=reads, writes=writes)

    f32 = lambda *s: memref(s, "f32")  # noqa: E731
    return [
        k("init", (f32(tq), f32(tq), f32(tq, d)), (), (0, 1, 2)),                            # -> m, l, acc
        k("qk", (memref((tq, d)), memref((tk, d)), f32(tq, tk)), (0, 1), (2,)),              # q, k -> s
        k("mask", (f32(tq, tk), "i32", "i32"), (0,), (0,)),                                   # s, q_pos0, k_pos0
        k("softmax", (f32(tq, tk), f32(tq), f32(tq), memref((tq, tk)), f32(tq)), (0, 1, 2), (1, 2, 3, 4)),  # -> p, corr
        k("pv", (memref((tq, tk)), memref((tk, d)), f32(tq), f32(tq, d)), (0, 1, 2, 3), (3,)),  # p, v, corr, acc
        k("finalize", (f32(tq, d), f32(tq), memref((tq, d))), (0, 1), (2,)),                  # acc, l -> o
    ]


def decode_attention(head_dim: int, group: int, chunk: int) -> list[ExternKernel]:
    """The primitives one decode-attention core calls, in call order: `attention`'s over the
    `group` query heads of one KV head (every row at the token's position) and chunks of
    `chunk` positions, without `finalize` (the splits' partial sums are merged instead)."""
    return attention(head_dim, group, chunk, row_step=0)[:5]


def attention_merge(head_dim: int, group: int, splits: int) -> ExternKernel:
    """out[group, d] = bf16(Σ_s w_s acc_s / Σ_s w_s l_s), w_s = exp(m_s - max m): one KV head's
    split-K partial results (acc [splits, group, d], stats [splits, group, (m, l)]) combined."""
    sym = f"attn_merge_d{head_dim}_g{group}_s{splits}"
    return ExternKernel(
        sym, "attention.cc",
        (memref((splits, group, head_dim), "f32"), memref((splits, group, 2), "f32"), memref((group, head_dim))),
        (("ATTN_HEAD_DIM", head_dim), ("ATTN_TILE_Q", group), ("ATTN_SPLITS", splits), ("ATTN_ONLY", "merge"),
         ("ATTN_SYMBOL", sym)),
        reads=(0, 1), writes=(2,),
    )


def externs_for_launch(launch: Launch) -> list[ExternKernel]:
    """The external kernels one group launch calls, from its op and parameters.

    Ops lowered by the compiler (rmsnorm, gemm, add) and the KV append (DMAs only) call none;
    gemm_q4nx calls only its dequantization (the product is the bf16 GEMM's linalg). The MLIR
    builders declare these and the object build compiles them, both through this one mapping.
    """
    if launch.op == "gemv":
        return [gemv(launch.p("tile_m"), launch.p("K"), launch.param_dict.get("tile_k"))]
    if launch.op == "gemv_q4nx":
        return [gemv_q4nx(launch.p("tile_k"), launch.p("K"))]
    if launch.op == "gemm_q4nx":
        return [dequant_q4nx(launch.p("tile_n"), launch.p("tile_k"))]
    if launch.op == "rope":
        return [rope(launch.p("head_dim"))]
    if launch.op == "swiglu":
        return [silu_and_mul(launch.p("tile"))]
    if launch.op == "flash_attn":
        if launch.p("tile_q") != launch.p("tile_kv"):
            raise ValueError(f"launch {launch.name!r}: the attention primitives need tile_q == tile_kv")
        return attention(launch.p("head_dim"), launch.p("tile_q"))
    if launch.op == "decode_attn":
        return decode_attention(launch.p("head_dim"), launch.p("q_heads") // launch.p("kv_heads"), launch.p("chunk"))
    if launch.op == "attn_merge":
        return [attention_merge(launch.p("head_dim"), launch.p("q_heads") // launch.p("kv_heads"), launch.p("splits"))]
    return []
