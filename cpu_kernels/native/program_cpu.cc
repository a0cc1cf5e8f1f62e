// A recorded sequence of this library's calls, replayed at a position in one call from Python.
//
// The simulated device runs a decode token as two device calls and a host attention a layer,
// then the LM head's call, each a few native calls with fixed pointers
// (cpu_kernels/native_program.py records them). Made one by one from Python, they leave the
// interpreter's work between them to run from caches the GEMVs have just flushed: tens of
// microseconds a step, several milliseconds a token. Replayed here, a token is one call. What
// changes from token to token is the position: each argument is its recorded value plus the
// position times a per-argument step (a KV row's address, a RoPE table row, an attention's
// length).
//
// An op is kOpWords int64: the code of the function (its index in kReplayed), the function's
// address, kMaxArgs arguments and kMaxArgs steps. The address is the one Python recorded, not
// this library's own: a call bound under another ISA class keeps that class's kernel. A float
// argument travels as its bits in the low 32 of its word.
//
// Which functions may be replayed, and with which argument kinds, comes from their prototypes
// (replayed.h) alone: `Entry` derives each one's kinds and its call from its C type.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "replayed.h"

namespace {

constexpr int64_t kMaxArgs = 9;
constexpr int64_t kOpWords = 2 + 2 * kMaxArgs;

using Q = int64_t;

// The argument kinds a word may carry, by the letter Python knows them by (native_cpu.ARG_TYPES):
// p pointer, q int64, i int, f float. A prototype with any other parameter type does not compile.
template <typename T>
struct Kind;

template <typename T>
struct Kind<T *> {
  static constexpr char letter = 'p';
  static T *from(Q v) { return reinterpret_cast<T *>(v); }
};

template <>
struct Kind<int64_t> {
  static constexpr char letter = 'q';
  static int64_t from(Q v) { return v; }
};

template <>
struct Kind<int> {
  static constexpr char letter = 'i';
  static int from(Q v) { return static_cast<int>(v); }
};

template <>
struct Kind<float> {
  static constexpr char letter = 'f';
  static float from(Q v) {
    const uint32_t bits = static_cast<uint32_t>(v);
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
};

using Invoke = void (*)(Q fn, const Q *args);

template <typename F>
struct Entry;

template <typename... A>
struct Entry<void (*)(A...)> {
  static_assert(sizeof...(A) <= kMaxArgs, "a replayed function takes at most kMaxArgs arguments");
  static constexpr char signature[] = {Kind<A>::letter..., '\0'};

  template <size_t... I>
  static void call(Q fn, const Q *a, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(Kind<A>::from(a[I])...);
  }

  static void invoke(Q fn, const Q *a) { call(fn, a, std::index_sequence_for<A...>{}); }
};

struct Replayed {
  const char *name;
  const char *signature;
  Invoke invoke;
};

#define REPLAYED(fn) {#fn, Entry<decltype(&fn)>::signature, &Entry<decltype(&fn)>::invoke}

// Every function of replayed.h, in code order.
const Replayed kReplayed[] = {
    REPLAYED(native_program_copy),   REPLAYED(rmsnorm_bf16_cpu),      REPLAYED(swiglu_bf16_cpu),
    REPLAYED(add_bf16_cpu),          REPLAYED(rope_bf16_cpu),         REPLAYED(gemv_packed_bf16_cpu_batch),
    REPLAYED(gemv_q4nx_cpu_batch),   REPLAYED(gemm_packed_bf16_cpu),  REPLAYED(gemm_q4nx_cpu),
    REPLAYED(gemm_q4nx_int_cpu),     REPLAYED(kv_store_row_bf16_cpu), REPLAYED(attention_bf16_cpu),
    REPLAYED(attention_at_bf16_cpu), REPLAYED(kv_append_bf16_cpu),    REPLAYED(decode_attn_bf16_cpu),  REPLAYED(attn_merge_bf16_cpu),
};
constexpr int64_t kCodes = sizeof(kReplayed) / sizeof(kReplayed[0]);

#undef REPLAYED

}  // namespace

extern "C" void native_program_copy(void *dst, const void *src, int64_t n) {
  std::memmove(dst, src, static_cast<size_t>(n));
}

extern "C" int64_t native_program_max_args() { return kMaxArgs; }

// The name of the function of `code`, or "" past the last: the recorder builds its table from
// these and `native_program_signature`.
extern "C" const char *native_program_function(int64_t code) {
  return code >= 0 && code < kCodes ? kReplayed[code].name : "";
}

// The argument kinds of the function of `code`, one letter each (see `Kind`), or "" past the last.
extern "C" const char *native_program_signature(int64_t code) {
  return code >= 0 && code < kCodes ? kReplayed[code].signature : "";
}

// Runs ops[0..n) in order at `pos`, adding each op's nanoseconds to ns[i] where `ns` is given
// (a profiled run: two clock reads an op, tens of nanoseconds); stops at an op of unknown code
// and returns its index (the recorder writes only known codes), else returns -1.
extern "C" int64_t native_program_run(const int64_t *ops, int64_t n, int64_t pos, int64_t *ns) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t *op = ops + i * kOpWords;
    if (op[0] < 0 || op[0] >= kCodes) return i;
    Q a[kMaxArgs];
    for (int64_t j = 0; j < kMaxArgs; ++j) a[j] = op[2 + j] + pos * op[2 + kMaxArgs + j];
    kReplayed[op[0]].invoke(op[1], a);
    if (ns != nullptr) {
      const auto t1 = std::chrono::steady_clock::now();
      ns[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
      t0 = t1;
    }
  }
  return -1;
}
