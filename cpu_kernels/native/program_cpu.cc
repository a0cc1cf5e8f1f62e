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
// An op is kOpWords int64: the signature's code, the function's address, kMaxArgs arguments
// and kMaxArgs steps. A float argument travels as its bits in the low 32 of its word.
#include <chrono>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxArgs = 9;
constexpr int64_t kOpWords = 2 + 2 * kMaxArgs;

// The signatures the recorder may use, in code order: p pointer, q int64, i int, f float.
// Code 0 is a byte copy (dst, src, n), the sync of a buffer or an activation passed on.
const char *const kSignatures[] = {"ppq", "pi", "pppq", "pppqqf", "pppqqq", "ppppqqq", "ppppqqqqq"};
constexpr int64_t kCodes = sizeof(kSignatures) / sizeof(kSignatures[0]);

using P = void *;
using Q = int64_t;

inline P p(Q v) { return reinterpret_cast<P>(v); }

inline float f(Q v) {
  uint32_t bits = static_cast<uint32_t>(v);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

}  // namespace

extern "C" int64_t native_program_max_args() { return kMaxArgs; }

// The signature of `code`, or "" past the last: the recorder builds its table from these.
extern "C" const char *native_program_signature(int64_t code) {
  return code >= 0 && code < kCodes ? kSignatures[code] : "";
}

// Runs ops[0..n) in order at `pos`, adding each op's nanoseconds to ns[i] where `ns` is given
// (a profiled run: two clock reads an op, tens of nanoseconds); stops at an op of unknown code
// and returns its index (the recorder writes only known codes), else returns -1.
extern "C" int64_t native_program_run(const int64_t *ops, int64_t n, int64_t pos, int64_t *ns) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t *op = ops + i * kOpWords;
    Q a[kMaxArgs];
    for (int64_t j = 0; j < kMaxArgs; ++j) a[j] = op[2 + j] + pos * op[2 + kMaxArgs + j];
    const Q fn = op[1];
    switch (op[0]) {
      case 0:
        std::memmove(p(a[0]), p(a[1]), static_cast<size_t>(a[2]));
        break;
      case 1:
        reinterpret_cast<void (*)(P, int)>(fn)(p(a[0]), static_cast<int>(a[1]));
        break;
      case 2:
        reinterpret_cast<void (*)(P, P, P, Q)>(fn)(p(a[0]), p(a[1]), p(a[2]), a[3]);
        break;
      case 3:
        reinterpret_cast<void (*)(P, P, P, Q, Q, float)>(fn)(p(a[0]), p(a[1]), p(a[2]), a[3], a[4], f(a[5]));
        break;
      case 4:
        reinterpret_cast<void (*)(P, P, P, Q, Q, Q)>(fn)(p(a[0]), p(a[1]), p(a[2]), a[3], a[4], a[5]);
        break;
      case 5:
        reinterpret_cast<void (*)(P, P, P, P, Q, Q, Q)>(fn)(p(a[0]), p(a[1]), p(a[2]), p(a[3]), a[4], a[5], a[6]);
        break;
      case 6:
        reinterpret_cast<void (*)(P, P, P, P, Q, Q, Q, Q, Q)>(fn)(p(a[0]), p(a[1]), p(a[2]), p(a[3]), a[4], a[5],
                                                                  a[6], a[7], a[8]);
        break;
      default:
        return i;
    }
    if (ns != nullptr) {
      const auto t1 = std::chrono::steady_clock::now();
      ns[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
      t0 = t1;
    }
  }
  return -1;
}
