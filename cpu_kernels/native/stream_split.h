// How a batch of decode GEMVs shares its weights among the threads of a team.
//
// Decode reads every weight once a token, so a GEMV batch runs at the rate memory streams.
// The hardware prefetchers keep a stream saturated when each core reads one long forward run
// of addresses (the bandwidth probe, bench/native/gemv_f32_stream.cc, is built that way). So
// the batch's blocks, job after job, are cut into one contiguous share per thread, balanced by
// bytes; a thread claims its own share a piece at a time from the front, and once it is done
// helps with the others' pieces, so a thread the host delays does not hold the batch up.
// Against chunks of about 1 MiB handed out dynamically, this read a token's Q4NX GEMVs 2-4 %
// faster (docs/profile.md, "One stream per core").
//
// Work a whole batch needs first (the Q4NX GEMV's conversion of its activations) is `Pieces`:
// claimed by whichever thread comes, and waited for by counting the pieces done, not the threads
// arrived, so a thread the host has not yet run holds up no one but itself.
//
// A test may hold one thread of a team back until every piece is claimed (`hold_if_asked`) and
// count who took what (`taken`): the kernel must finish its work on the others
// (tests/test_threads.py). Holding is off unless a test sets it; counting is one add to a
// thread's own cache line a piece.
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace native {

constexpr int kCountedThreads = 64;

struct alignas(64) Taken {
  std::atomic<int64_t> pieces{0};
};

// The thread a test holds back (-1: none) and the pieces each thread has taken since reset.
inline std::atomic<int> held_thread{-1};
inline Taken taken[kCountedThreads];

inline void count_piece() {
  const int t = omp_get_thread_num();
  if (t < kCountedThreads) taken[t].pieces.fetch_add(1, std::memory_order_relaxed);
}

// Pieces 0..n-1 for any thread of a team to take; `wait` returns once all are done.
class Pieces {
  static constexpr int kSpinsBeforeYield = 4096;

 public:
  explicit Pieces(int64_t n) : n_(n) {}

  template <class Fn>
  void run(Fn &&fn) {
    for (int64_t p; (p = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) {
      fn(p);
      count_piece();
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // Waits only for pieces other threads have claimed and not finished: microseconds, unless
  // the host took such a thread's core mid-piece; then, after about a tenth of a millisecond
  // of spinning, this thread gives its core up between looks rather than keep it from them.
  void wait() const {
    for (int spins = 0; done_.load(std::memory_order_acquire) < n_; ++spins) {
      if (spins < kSpinsBeforeYield)
        _mm_pause();
      else
        sched_yield();
    }
  }

  bool all_claimed() const { return next_.load(std::memory_order_relaxed) >= n_; }

 private:
  const int64_t n_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
};

// Pieces a share is claimed in: small enough that a helper ends the batch within about one,
// large enough that claiming costs nothing against reading one.
constexpr int64_t kPieceBytes = 128 * 1024;

class StreamSplit {
 public:
  // Job i has blocks[i] blocks of block_bytes[i] bytes each. Made before the parallel region,
  // with a share for every thread the region may have.
  StreamSplit(const std::vector<int64_t> &blocks, const std::vector<int64_t> &block_bytes)
      : first_(blocks.size() + 1, 0) {
    const size_t jobs = blocks.size();
    int64_t widest = 1, total_bytes = 0;
    for (size_t i = 0; i < jobs; ++i) {
      first_[i + 1] = first_[i] + blocks[i];
      widest = std::max(widest, block_bytes[i]);
      total_bytes += blocks[i] * block_bytes[i];
    }
    piece_ = std::max<int64_t>(1, kPieceBytes / widest);
    const int shares = std::max(1, omp_get_max_threads());
    start_.assign(shares + 1, first_[jobs]);
    // Share r starts at the first block whose bytes begin at or past r / shares of the total.
    size_t i = 0;
    int64_t before = 0;   // bytes of jobs 0..i-1
    for (int r = 0; r < shares; ++r) {
      const int64_t at = total_bytes * r / shares;
      while (i < jobs && before + blocks[i] * block_bytes[i] <= at) before += blocks[i] * block_bytes[i], ++i;
      start_[r] = i < jobs ? first_[i] + (at - before + block_bytes[i] - 1) / block_bytes[i] : first_[jobs];
    }
    next_ = std::make_unique<std::atomic<int64_t>[]>(shares);
    for (int r = 0; r < shares; ++r) next_[r].store(start_[r], std::memory_order_relaxed);
  }

  // Called by every thread of the team: fn(job, block) runs once for every block of the batch,
  // over the whole team. A team smaller than the shares leaves none undone: every thread
  // goes through every share, its own first.
  template <class Fn>
  void run(Fn &&fn) {
    const int shares = static_cast<int>(start_.size()) - 1;
    const int own = omp_get_thread_num() % shares;
    for (int o = 0; o < shares; ++o) {
      const int r = (own + o) % shares;
      for (;;) {
        const int64_t b0 = next_[r].fetch_add(piece_, std::memory_order_relaxed);
        if (b0 >= start_[r + 1]) break;
        const int64_t b1 = std::min(b0 + piece_, start_[r + 1]);
        count_piece();
        size_t job = std::upper_bound(first_.begin(), first_.end(), b0) - first_.begin() - 1;
        for (int64_t b = b0; b < b1; ++b) {
          while (b >= first_[job + 1]) ++job;
          fn(static_cast<int>(job), b - first_[job]);
        }
      }
    }
  }

  bool all_claimed() const {
    const int shares = static_cast<int>(start_.size()) - 1;
    for (int r = 0; r < shares; ++r)
      if (next_[r].load(std::memory_order_relaxed) < start_[r + 1]) return false;
    return true;
  }

 private:
  std::vector<int64_t> first_;                   // the batch's index of job i's first block; then the total
  std::vector<int64_t> start_;                   // share r: blocks start_[r] .. start_[r + 1] - 1
  int64_t piece_ = 1;                            // blocks claimed at a time
  std::unique_ptr<std::atomic<int64_t>[]> next_;  // share r's next unclaimed block
};

// At the start of a parallel region: the thread a test holds back waits until `work` is all
// claimed by the others (never in a team of one, which would wait for itself).
template <class... Work>
inline void hold_if_asked(const Work &...work) {
  const int held = held_thread.load(std::memory_order_relaxed);
  if (held < 0 || held != omp_get_thread_num() || omp_get_num_threads() < 2) return;
  while (!(work.all_claimed() && ...)) _mm_pause();
}

}  // namespace native
