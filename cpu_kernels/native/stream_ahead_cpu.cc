// The decode GEMVs' prefetch tuners (stream_ahead.h), one per weight format, and their controls.
#include <cstdint>

#include "stream_ahead.h"

namespace native {

AheadTuner &ahead_tuner(StreamFormat format) {
  static AheadTuner tuners[2];
  return tuners[static_cast<int>(format)];
}

}  // namespace native

namespace {

native::AheadTuner &tuner_of(int format) {
  return native::ahead_tuner(format == 0 ? native::StreamFormat::kQ4nx : native::StreamFormat::kPackedBf16);
}

}  // namespace

// Holds both formats at `bytes` ahead; 0 lets them tune again from the start.
extern "C" void stream_ahead_pin(int64_t bytes) {
  tuner_of(0).pin(bytes);
  tuner_of(1).pin(bytes);
}

// The distance format 0 (Q4NX) or 1 (packed bf16) uses now, and how often it has moved.
extern "C" int64_t stream_ahead_bytes(int format) { return tuner_of(format).ahead(); }
extern "C" int stream_ahead_moves(int format) { return tuner_of(format).moves(); }

// The ladder of distances the tuners choose from; returns its length.
extern "C" int stream_ahead_ladder(int64_t *out) {
  for (int i = 0; i < native::kAheadArms; ++i) out[i] = native::kAheadLadder[i];
  return native::kAheadArms;
}

// A fresh tuner driven by given times, for tests: call i has bytes[i] of weights and would take
// ns[i * kAheadArms + arm] at each rung of the ladder; arm_out[i] is the rung it was run at.
extern "C" void stream_ahead_replay(const int64_t *bytes, const double *ns, int64_t calls, int32_t *arm_out) {
  native::AheadTuner tuner;
  for (int64_t i = 0; i < calls; ++i) {
    const native::AheadTuner::Pick p = tuner.pick(bytes[i]);
    tuner.done(p, ns[i * native::kAheadArms + p.arm]);
    arm_out[i] = p.arm;
  }
}
