// How far ahead of its reads a decode GEMV asks for its weights, chosen while it runs.
//
// The best distance is not a property of the kernel alone. On the 2-core Zen 5 VM the host's
// memory switches between two states within minutes: at about 45 GB/s, 5 KiB ahead was best
// and 10 KiB 3 % slower; at about 80 GB/s, 10 KiB was 9 % faster than 5 (docs/profile.md,
// "Asking for the weights ahead"). Another CPU will have other numbers. So each GEMV format
// keeps a tuner: it runs most calls at its current distance and a few at a neighbouring one
// on a ladder of distances a factor of two apart, compares each of those with the recent
// calls of the same size at the current distance, and moves when a neighbour has been faster
// by more than a margin over enough calls. A prefetch moves no data the kernel sees, so the
// distance never changes a result.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace native {

constexpr int kAheadArms = 4;
constexpr int64_t kAheadLadder[kAheadArms] = {2560, 5120, 10240, 20480};
constexpr int kAheadStart = 1;   // 5 KiB: the best in the host's slower state, where it spends most time

class AheadTuner {
 public:
  struct Pick {
    int arm;          // -1: pinned
    int kind;
    int64_t ahead;    // bytes
  };

  // The distance for the next call, whose weights are `bytes` long (calls of one size are
  // compared with each other: their fixed costs are alike).
  Pick pick(int64_t bytes) {
    std::lock_guard<std::mutex> hold(mu_);
    if (pinned_ > 0) return {-1, -1, pinned_};
    int k = 0;
    while (k < n_kinds_ && kinds_[k].bytes != bytes) ++k;
    if (k == n_kinds_) {
      if (n_kinds_ == kMaxKinds) n_kinds_ = 0, k = 0;   // a new model's sizes: start the table again
      kinds_[n_kinds_++] = {bytes, 0.0, 0};
    }
    int arm = best_;
    if (kinds_[k].seen >= 2 && next_random() % kExploreEvery == 0) {
      const bool down = best_ > 0 && (best_ == kAheadArms - 1 || next_random() % 2 == 0);
      arm = down ? best_ - 1 : best_ + 1;
    }
    return {arm, k, kAheadLadder[arm]};
  }

  // What the call picked took, in ns.
  void done(const Pick &p, double ns) {
    std::lock_guard<std::mutex> hold(mu_);
    if (p.arm < 0 || pinned_ > 0 || p.kind >= n_kinds_) return;
    Kind &kind = kinds_[p.kind];
    if (p.arm == best_) {
      kind.base_ns = kind.seen == 0 ? ns : kind.base_ns + kBaseWeight * (ns - kind.base_ns);
      ++kind.seen;
      return;
    }
    if (kind.seen < 2 || (p.arm != best_ - 1 && p.arm != best_ + 1)) return;   // picked before a move
    // Weighted by the calls' time, the sums estimate the change in a whole token's time; one
    // call the host delayed counts for at most a quarter of its baseline.
    const double b = kind.base_ns, d = std::clamp(ns - b, -0.25 * b, 0.25 * b);
    Evidence &e = evidence_[p.arm];
    e.diff = e.diff * kDecay + d;
    e.base = e.base * kDecay + b;
    e.calls = e.calls * kDecay + 1.0;
    if (e.calls >= kMinCalls && e.diff < -kMargin * e.base) move_to(p.arm);
  }

  // bytes > 0 holds the distance there (comparisons, tests); 0 tunes again from the start.
  void pin(int64_t bytes) {
    std::lock_guard<std::mutex> hold(mu_);
    pinned_ = std::max<int64_t>(bytes, 0);
    move_to(kAheadStart);
  }

  int64_t ahead() {
    std::lock_guard<std::mutex> hold(mu_);
    return pinned_ > 0 ? pinned_ : kAheadLadder[best_];
  }

  int moves() {
    std::lock_guard<std::mutex> hold(mu_);
    return moves_;
  }

 private:
  static constexpr int kMaxKinds = 16;
  static constexpr uint64_t kExploreEvery = 8;   // about 1 call in 8 tries a neighbour
  static constexpr double kBaseWeight = 0.25;    // a size's baseline follows its last few calls
  static constexpr double kDecay = 0.9;          // a neighbour's evidence covers its last ~10 calls
  static constexpr double kMinCalls = 6.0;
  static constexpr double kMargin = 0.01;        // 1 % faster, time-weighted

  struct Kind {
    int64_t bytes;
    double base_ns;   // recent calls of this size at the current distance
    int seen;
  };
  struct Evidence {
    double diff = 0, base = 0, calls = 0;
  };

  void move_to(int arm) {
    if (arm != best_) ++moves_;
    best_ = arm;
    for (auto &e : evidence_) e = Evidence{};
    for (int k = 0; k < n_kinds_; ++k) kinds_[k].seen = 0;   // baselines belong to the old distance
  }

  uint64_t next_random() {   // xorshift64: cheap, and the same sequence in every run
    rng_ ^= rng_ << 13;
    rng_ ^= rng_ >> 7;
    rng_ ^= rng_ << 17;
    return rng_;
  }

  std::mutex mu_;
  int best_ = kAheadStart;
  int moves_ = 0;
  int64_t pinned_ = 0;
  uint64_t rng_ = 0x9E3779B97F4A7C15ull;
  Kind kinds_[kMaxKinds] = {};
  int n_kinds_ = 0;
  Evidence evidence_[kAheadArms];
};

// The tuner of each decode GEMV format (stream_ahead_cpu.cc).
enum class StreamFormat { kQ4nx = 0, kPackedBf16 = 1 };
AheadTuner &ahead_tuner(StreamFormat format);

// One timed call of a GEMV batch: picks its distance when made, reports its time when it ends.
class AheadCall {
 public:
  AheadCall(StreamFormat format, int64_t bytes)
      : tuner_(ahead_tuner(format)), pick_(tuner_.pick(bytes)), t0_(std::chrono::steady_clock::now()) {}
  ~AheadCall() {
    tuner_.done(pick_, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0_).count());
  }
  AheadCall(const AheadCall &) = delete;
  AheadCall &operator=(const AheadCall &) = delete;
  int64_t ahead() const { return pick_.ahead; }

 private:
  AheadTuner &tuner_;
  const AheadTuner::Pick pick_;
  const std::chrono::steady_clock::time_point t0_;
};

}  // namespace native
