// The AMX tile vocabulary the tile GEMM is written in, and each library's ISA probe.
//
// Three builds define tiles differently (native_cpu.py picks one at run time):
//   - amx (-mamx-tile -mamx-bf16 over AVX512-BF16): the eight tile registers and TDPBF16PS.
//   - amx-emulated (-DNATIVE_TILES_EMULATED over AVX2): eight 1 KiB tiles per thread in memory,
//     and a TDPBF16PS that computes what the Intel SDM's pseudo-code specifies, in the same
//     order: per row, an even and an odd f32 sum over the instruction's 16 K-pairs, each step
//     one rounded FMA, then dest + (even + odd); subnormal inputs read as 0 and subnormal results
//     flush to 0 (MXCSR's DAZ and FTZ, set around the step). It lets a CPU without AMX run and
//     test the tile GEMM's blocking, layouts and rounding (at about a quarter of the vector GEMM's speed).
//   - the vector-only classes (avx512bf16, avx2): no tiles; NATIVE_TILES is 0.
// The emulation follows the SDM, not a measured AMX core: docs/profile.md says what was run where.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "packed_tiles.h"
#include "simd_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define NATIVE_TILES 1
#define NATIVE_TILES_REAL 1
#elif defined(NATIVE_TILES_EMULATED)
#define NATIVE_TILES 1
#else
#define NATIVE_TILES 0
#endif

namespace native {

#if NATIVE_TILES_REAL
constexpr const char *kIsa = "amx";
#elif NATIVE_TILES
constexpr const char *kIsa = "amx-emulated";
#else
constexpr const char *kIsa = kVectorIsa;
#endif

#if NATIVE_TILES_REAL
// Linux keeps a process's AMX tile state disabled (and the instructions faulting) until the
// process asks for it: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once, for all threads.
inline bool os_grants_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}
inline bool cpu_has_isa() {
  return cpu_has_vector_isa() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         os_grants_tiles();
}
#else
inline bool cpu_has_isa() { return cpu_has_vector_isa(); }
#endif

// Where a GEMM's weights come from: block `blk` (16 outputs over all K) written as plain tile
// vectors, K-pair p at out + 16 p. The GEMMs decode a panel of blocks once and reuse it for
// every row of A, so they need nothing else of a weight format.
struct BlockSource {
  virtual void decode(int64_t blk, uint32_t *out) const = 0;
  virtual ~BlockSource() = default;
};

// Prefill's GEMM on tiles (matmul_tiles_bf16_cpu.cc); false where the build has no tiles or K
// is not a whole number of tile steps, and the caller then runs the vector GEMM.
bool tiles_gemm(const uint16_t *a, const BlockSource &w, uint16_t *c, int64_t m, int64_t n, int64_t k);

}  // namespace native

#if NATIVE_TILES
namespace tiles {

constexpr int kRows = 16;        // rows per tile
constexpr int kRowBytes = 64;    // bytes per tile row: 16 f32 sums, or 16 bf16 pairs
constexpr int kPairs = 16;       // K-pairs one TDPBF16PS consumes (an A row, B's rows)

// Every tile register holds 16 rows of 64 bytes.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved0[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config() {
    for (int t = 0; t < 8; ++t) colsb[t] = kRowBytes, rows[t] = kRows;
  }
};

#if NATIVE_TILES_REAL

// Per thread: the configuration is thread state, as the registers are.
inline void configure() {
  static const Config config;
  _tile_loadconfig(&config);
}
inline void release() { _tile_release(); }
// The intrinsics name their tile registers by literal number (they spell it into the assembly),
// so the tile operations are macros over literal register numbers in both builds.
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_DOT(c, a, b) _tile_dpbf16ps(c, a, b)

#else  // emulated

struct alignas(64) Registers {
  uint8_t t[8][kRows][kRowBytes];
};
inline Registers &regs() {
  static thread_local Registers r;
  return r;
}
inline void configure() { std::memset(&regs(), 0, sizeof(Registers)); }
inline void release() {}
template <int T> inline void zero() { std::memset(regs().t[T], 0, sizeof(regs().t[T])); }
template <int T> inline void load(const void *p, int64_t stride) {
  for (int r = 0; r < kRows; ++r) std::memcpy(regs().t[T][r], static_cast<const uint8_t *>(p) + r * stride, kRowBytes);
}
template <int T> inline void store(void *p, int64_t stride) {
  for (int r = 0; r < kRows; ++r) std::memcpy(static_cast<uint8_t *>(p) + r * stride, regs().t[T][r], kRowBytes);
}
inline float bf16_f32(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// C[m][n] += Σ_k A[m].pair[k] · B[k].pair[n], as the SDM's pseudo-code orders it (see the top).
template <int C, int A, int B> inline void dot() {
  constexpr unsigned kDazFtz = 0x8040;
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | kDazFtz);
  Registers &r = regs();
  for (int m = 0; m < kRows; ++m) {
    native::F16 even = native::zero(), odd = native::zero();
    for (int k = 0; k < kPairs; ++k) {
      uint32_t pair;
      std::memcpy(&pair, r.t[A][m] + 4 * k, 4);
      const native::P16 b = native::load_pairs(r.t[B][k]);
      even = native::fma(native::evens(b), native::set1(bf16_f32(pair & 0xFFFF)), even);
      odd = native::fma(native::odds(b), native::set1(bf16_f32(pair >> 16)), odd);
    }
    float *dest = reinterpret_cast<float *>(r.t[C][m]);
    native::store_f32(dest, native::add(native::load_f32(dest), native::add(even, odd)));
  }
  _mm_setcsr(csr);
}

#define TILE_ZERO(t) tiles::zero<t>()
#define TILE_LOAD(t, p, stride) tiles::load<t>(p, stride)
#define TILE_STORE(t, p, stride) tiles::store<t>(p, stride)
#define TILE_DOT(c, a, b) tiles::dot<c, a, b>()

#endif
}  // namespace tiles
#endif

// The ISA class a library was built for, and whether this CPU runs it: native_cpu.py loads a
// library only where its probe says yes. Defined once per library (matmul_bf16_cpu.cc).
#define NATIVE_DEFINE_ISA_PROBES                                                  \
  extern "C" const char *native_cpu_isa() { return native::kIsa; }                \
  extern "C" int native_cpu_isa_supported() { return native::cpu_has_isa() ? 1 : 0; }
