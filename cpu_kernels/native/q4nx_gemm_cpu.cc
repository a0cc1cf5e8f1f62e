// Prefill's GEMM on Q4NX weights in the simulated device's form (q4nx_blocks.h), on decode's
// contract (q4nx_cpu.cc): each output row is what the GEMV computes for that activation row, to
// the bit. On AVX2 the float GEMM is bound by two 8-wide FMAs a cycle (16 multiply-adds);
// vpmaddubsw forms 32 byte products a cycle per pipe, twice the multiply-adds at two bytes per
// activation, four times at one. What makes it pay is reuse: each load of values is unpacked
// once for several rows of A, each activation row is converted once per call
// (q4nx_activations.h), and a task's rows of A and its row-block stay in the core's L2. The
// `avx512` class (Intel's cores, where vdpbf16ps is slow) runs it too, with vpdpbusd on one-byte
// activations: 2.6 times its FMA GEMM. `avx512bf16` keeps the dequantizing GEMM: with its wide
// activations vdpbf16ps already runs at vpdpbusd's rate on a Zen 5.

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "q4nx_activations.h"
#include "q4nx_blocks.h"
#include "replayed.h"

namespace {

using q4nx::kBytesPerCol;
using q4nx::kGroup;
using q4nx::kRows;
using q4nx::convert_row;

// Rows first.. of A in decode's fixed point, converted once for every row-block to read, into a
// buffer that outlives the call: a prefill's GEMM would otherwise fault in fresh pages for it
// on every call (at 2048 x 8192, 36 MB, a tenth of the GEMM's time).
struct RowActivations {
  int64_t units, groups, first = 0;
  int32_t *hl = nullptr;                   // per row: convert_row's words, kActBytes per unit
  float *unit = nullptr, *sum = nullptr;   // [rows][groups]
  RowActivations(int64_t k, int64_t rows) : units(k / q4nx::kUnitCols), groups(k / kGroup) {
    static thread_local std::vector<int32_t> buf;
    const size_t need = static_cast<size_t>(rows * (units * q4nx::kActBytes + groups * 2));
    if (buf.size() < need) buf.resize(need);
    hl = buf.data();
    unit = reinterpret_cast<float *>(hl + rows * units * q4nx::kActBytes);
    sum = unit + rows * groups;
  }
  // Called by every thread of a team: rows r0..r1 of A become rows 0.. of the buffer.
  void convert(const uint16_t *a, int64_t k, int64_t r0, int64_t r1) {
#pragma omp single
    first = r0;
#pragma omp for schedule(static)
    for (int64_t r = r0; r < r1; ++r)
      convert_row(a + r * k, k, row(r), unit_row(r), sum_row(r));
  }
  int32_t *row(int64_t r) const { return hl + (r - first) * units * q4nx::kActBytes; }
  float *unit_row(int64_t r) const { return unit + (r - first) * groups; }
  float *sum_row(int64_t r) const { return sum + (r - first) * groups; }
};

// Rows r0.. r0 + R - 1 of a register tile: each one's activation words, units and sums.
template <int R>
struct TileRows {
  const int32_t *x[R];
  const float *unit[R], *sum[R];
  TileRows(const RowActivations &act, int64_t r0) {
    for (int i = 0; i < R; ++i) {
      x[i] = act.row(r0 + i);
      unit[i] = act.unit_row(r0 + i);
      sum[i] = act.sum_row(r0 + i);
    }
  }
};

#if NATIVE_AVX2

// Rows of A a register tile takes (int_tile below): as many as 8 sums a row set leave room for.
constexpr int kTileRows = q4nx::kActBytes == 1 ? 4 : 2;

// R rows of A against 16 rows of one row-block, over all K: rows 8 h .. 8 h + 7 (the low nibbles
// of the 32-byte half h of every unit) and the 8 rows 16 above them (the high nibbles).
//
// Registers (16 ymm): per row of A, 16-bit sums for 2 row sets times the activation's bytes
// (wide: Xh, Xl; narrow: X), so wide R = 2 takes 8 and narrow R = 4 takes 8, plus the two
// unpacked value vectors, the broadcast activation bytes and the products; each 32-byte load is
// unpacked once for all R rows. The f32 outputs are touched once a group.
//
// Saturation: vpmaddubsw adds two products of a value (at most 15) and a signed byte (at least
// -128), so each 16-bit lane is within 2 * 15 * 128 = 3840; a group adds kGroup / 4 = 8 of them
// per lane before widening, at most 30720 < 2^15, so nothing saturates or wraps (a ninth would).
//
// With AVX-VNNI (the `avxvnni` class, one-byte activations) the sums are vpdpbusd's 32-bit ones
// of the whole bytes and the high nibbles, as in group_f32_narrow: nothing to saturate, no
// widening, and the low-nibble mask gone. On the Xeon of docs/profile.md the GEMM ran at 0.40
// TFLOP/s against vpmaddubsw's 0.31, alike for 4, 5 or 6 rows of A.
template <int R>
void int_tile(const uint8_t *rb, int64_t k, int half, const RowActivations &act, int64_t r0, uint16_t *c,
              int64_t ldc) {
  static_assert(kGroup / q4nx::kUnitCols * 2 * 15 * 128 < 32768, "16-bit group sums would saturate");
  constexpr int B = q4nx::kActBytes;   // sums per row set, and int32 words per unit
  constexpr bool kVnni = NATIVE_AVXVNNI && B == 1;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), x256 = _mm256_set1_epi16(256);
  const TileRows<R> t(act, r0);
  __m256 y[R][2];
  for (auto &v : y) v[0] = v[1] = _mm256_setzero_ps();
  const int64_t groups = k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const q4nx::Group grp = q4nx::group(rb, g);
    const uint8_t *values = grp.values + 32 * half;
    const int64_t u0 = g * (kGroup / q4nx::kUnitCols);
    __m256i s[R][2 * B];   // [low, high nibbles][x Xh, x Xl (wide) | x X (narrow)]
    for (int i = 0; i < R; ++i)
      for (auto &v : s[i]) v = _mm256_setzero_si256();
    for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; ++u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + u * q4nx::kUnitBytes));
      const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      if constexpr (kVnni) {   // 32-bit sums of the whole bytes and the high nibbles (group_f32_narrow)
        for (int i = 0; i < R; ++i) {
          const __m256i xb = _mm256_set1_epi32(t.x[i][u0 + u]);
          s[i][0] = _mm256_dpbusd_avx_epi32(s[i][0], v, xb);
          s[i][1] = _mm256_dpbusd_avx_epi32(s[i][1], qh, xb);
        }
      } else {
        const __m256i q[2] = {_mm256_and_si256(v, nib), qh};
        for (int i = 0; i < R; ++i)
          for (int b = 0; b < B; ++b) {
            const __m256i xb = _mm256_set1_epi32(t.x[i][B * (u0 + u) + b]);
            for (int n = 0; n < 2; ++n)
              s[i][B * n + b] = _mm256_add_epi16(s[i][B * n + b], _mm256_maddubs_epi16(q[n], xb));
          }
      }
      // Each unit's sums stay in their registers: left alone, GCC unrolls the group and forms
      // every product before adding any, which spills them all.
      for (int i = 0; i < R; ++i)
        for (auto &v : s[i]) asm("" : "+x"(v));
    }
    // The GEMV's combination, lane for lane: (scale * u) * sum(q X) + min * sum, two FMAs.
    for (int j = 0; j < 2; ++j) {
      const int rows = 8 * half + 16 * j;
      const __m256 scale = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(grp.scales + rows)));
      const __m256 mins = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(grp.mins + rows)));
      for (int i = 0; i < R; ++i) {
        const __m256i s32 = kVnni   ? (j == 0 ? _mm256_sub_epi32(s[i][0], _mm256_slli_epi32(s[i][1], 4)) : s[i][1])
                            : B == 2 ? _mm256_add_epi32(_mm256_madd_epi16(s[i][2 * j], x256),
                                                        _mm256_madd_epi16(s[i][2 * j + 1], ones))
                                     : _mm256_madd_epi16(s[i][j], ones);
        y[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(scale, _mm256_set1_ps(t.unit[i][g])), y[i][j]);
        y[i][j] = _mm256_fmadd_ps(mins, _mm256_set1_ps(t.sum[i][g]), y[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j)
      _mm_storeu_si128(reinterpret_cast<__m128i *>(c + i * ldc + 8 * half + 16 * j), native::round_bf16(y[i][j]));
}

// Rows r0..r1 of A against one row-block (32 outputs), in two passes of 16.
void int_block(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, int64_t r1, uint16_t *c,
               int64_t ldc) {
  for (int half = 0; half < 2; ++half) {
    int64_t r = r0;
    for (; r + kTileRows <= r1; r += kTileRows) int_tile<kTileRows>(rb, k, half, act, r, c + r * ldc, ldc);
    for (; r < r1; ++r) int_tile<1>(rb, k, half, act, r, c + r * ldc, ldc);
  }
}

#elif Q4NX_ACT_BYTES == 1

// Rows of A a register tile takes (int_tile below): its 4 R accumulators and the vectors a unit
// needs fit the 32 zmm registers. On the Xeon (docs/profile.md, "Which CPU") 6 rows ran at
// 0.71-0.73 TFLOP/s, 4 at 0.69-0.70 and 8, which spill, at 0.67.
constexpr int kTileRows = 6;

// R rows of A against all 32 rows of one row-block, over all K: each 64-byte unit is loaded and
// its high nibbles taken once for all R rows, and each row's group sums are group_f32_narrow's
// (the whole bytes' and the high nibbles' dot products), combined into the f32 outputs in the
// GEMV's order once a group.
template <int R>
void int_tile(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, uint16_t *c, int64_t ldc) {
  const __m512i nib = _mm512_set1_epi8(15);
  const TileRows<R> t(act, r0);
  __m512 y[R][2];
  for (auto &v : y) v[0] = v[1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const q4nx::Group grp = q4nx::group(rb, g);
    const int32_t u0 = static_cast<int32_t>(g * (kGroup / q4nx::kUnitCols));
    __m512i s[R][2];   // [whole bytes, high nibbles]
    for (auto &v : s) v[0] = v[1] = _mm512_setzero_si512();
    for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; ++u) {
      const __m512i v = _mm512_loadu_si512(grp.values + u * q4nx::kUnitBytes);
      const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      for (int i = 0; i < R; ++i) {
        const __m512i b = _mm512_set1_epi32(t.x[i][u0 + u]);
        s[i][0] = _mm512_dpbusd_epi32(s[i][0], v, b);
        s[i][1] = _mm512_dpbusd_epi32(s[i][1], qh, b);
      }
    }
    const native::F16 scale[2] = {native::load_bf16(grp.scales), native::load_bf16(grp.scales + native::kWidth)};
    const native::F16 mins[2] = {native::load_bf16(grp.mins), native::load_bf16(grp.mins + native::kWidth)};
    for (int i = 0; i < R; ++i) {
      const __m512 sums[2] = {_mm512_cvtepi32_ps(_mm512_sub_epi32(s[i][0], _mm512_slli_epi32(s[i][1], 4))),
                              _mm512_cvtepi32_ps(s[i][1])};
      const __m512 uu = _mm512_set1_ps(t.unit[i][g]), xs = _mm512_set1_ps(t.sum[i][g]);
      for (int j = 0; j < 2; ++j) y[i][j] = _mm512_fmadd_ps(sums[j], _mm512_mul_ps(scale[j].v, uu), y[i][j]);
      for (int j = 0; j < 2; ++j) y[i][j] = _mm512_fmadd_ps(mins[j].v, xs, y[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) native::store_bf16(c + i * ldc + j * native::kWidth, {y[i][j]});
}

// Rows r0..r1 of A against one row-block (32 outputs).
void int_block(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, int64_t r1, uint16_t *c,
               int64_t ldc) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) int_tile<kTileRows>(rb, k, act, r, c + r * ldc, ldc);
  for (; r < r1; ++r) int_tile<1>(rb, k, act, r, c + r * ldc, ldc);
}

#else

constexpr int kTileRows = 2;

// AVX-512 with wide activations has no tile: each row of A through the GEMV's own row-block, so
// the bits are the GEMV's by construction. Slow (nothing is reused between rows): those classes'
// prefill keeps the dequantizing GEMM, and this serves the tests that hold every class to one
// contract.
void int_block(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, int64_t r1, uint16_t *c,
               int64_t ldc) {
  for (int64_t r = r0; r < r1; ++r)
    q4nx::gemv_row_block(rb, k, act.row(r), act.row(r) + act.units, act.unit_row(r), act.sum_row(r), c + r * ldc,
                   native::stream_ahead());
}

#endif

// A task is one row-block against a block of rows of A whose fixed-point bytes (kActBytes K
// each) fill about half a core's 1 MiB L2 next to the row-block (20 K bytes): measured with
// two-byte activations on 2048 x 8192, 64 rows (1 MiB of them) ran 20 % slower than 16 or 32;
// on K = 2048 anything from 32 to 256 is alike. A block is whole register tiles.
constexpr int64_t kTaskActBytes = 512 * 1024;
// Rows converted at a time: the buffer stays a few MiB however long the prompt.
constexpr int64_t kConvertBytes = 4 * 1024 * 1024;

}  // namespace

// C[m][n] = A[m][k] · Wᵀ with W in Q4NX (device form), on decode's contract: row i is exactly what
// gemv_q4nx_cpu_batch computes for x = A[i] (the same fixed-point activations and exact integer
// group sums, combined in the same f32 order, rounded to bf16 once), so a prefill on this
// kernel and a decode step agree to the bit on the same row. Tasks of (row-block, block of rows)
// are scheduled dynamically over the team; each row of A is converted once per call.
extern "C" void gemm_q4nx_int_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = n / kRows, rb_bytes = k * kBytesPerCol;
  const int64_t row_bytes = q4nx::kActBytes * k;
  int64_t mb = kTaskActBytes / row_bytes / kTileRows * kTileRows;
  mb = mb < kTileRows ? kTileRows : mb;
  int64_t rows = kConvertBytes / row_bytes / mb * mb;
  rows = rows < mb ? mb : rows;
  rows = rows > m ? m : rows;
  RowActivations act(k, rows);
#pragma omp parallel
  for (int64_t s0 = 0; s0 < m; s0 += rows) {
    const int64_t s1 = s0 + rows < m ? s0 + rows : m, mblocks = (s1 - s0 + mb - 1) / mb;
    act.convert(a, k, s0, s1);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < blocks * mblocks; ++t) {
      const int64_t b = t % blocks, r0 = s0 + t / blocks * mb, r1 = r0 + mb < s1 ? r0 + mb : s1;
      int_block(w + b * rb_bytes, k, act, r0, r1, c + b * kRows, n);
    }
  }
}
