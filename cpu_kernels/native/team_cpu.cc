// What a test may ask of a kernel's thread team (stream_split.h): hold one thread back until
// the others have claimed all the work, and count the pieces each thread took. The kernels
// that split their work this way (the decode GEMV batches) must then finish without the held
// thread's help and give the same numbers (tests/test_threads.py).
#include <cstdint>

#include "stream_split.h"

extern "C" {

// -1 holds no thread (the default).
void native_hold_thread(int thread) { native::held_thread.store(thread, std::memory_order_relaxed); }

void native_taken_reset() {
  for (auto &t : native::taken) t.pieces.store(0, std::memory_order_relaxed);
}

int64_t native_taken(int thread) {
  return thread >= 0 && thread < native::kCountedThreads ? native::taken[thread].pieces.load() : -1;
}

}  // extern "C"
