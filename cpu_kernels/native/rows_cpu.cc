// Rows of a matrix in a file, read at token ids: the host's embedding lookups and a 4-bit
// head's rescored candidates (llama_runtime/safetensors_io.FileRows); and the choice of those
// candidates (top_k_ids_cpu, at the end). A few hundred rows a token, each its own pread: one
// Python call for all of them keeps the interpreter's per-call cost (about 4 µs a row) out of
// every decode step.
//
// A row the page cache lacks is a disk read, and read one after another a step's misses wait
// for each other (about 55 µs each on a VM's disk: 14 ms for 256 cold rows). So the rows are
// read in two passes: first each without waiting for the disk (preadv2 with RWF_NOWAIT, which
// returns what the page cache holds), then every row still missing is asked of the page cache
// at once (POSIX_FADV_WILLNEED starts its read and returns), and only then read as usual, its
// disk read by then in flight beside the others'. A warm step costs one call a row, as before.

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <vector>

namespace {

// Fewer rows than this (an embedding lookup's one) are read on the calling thread alone.
constexpr int64_t kParallelRows = 32;

// The bytes of `dst` from `at` on, reading the rest of the row; false on a short read at the
// end of the file or an error. `flags` 0 waits for the disk; RWF_NOWAIT stops at what is cached.
bool read_rest(int fd, uint8_t *dst, int64_t row_bytes, int64_t at, int64_t &done, int flags) {
  while (done < row_bytes) {
    iovec io{dst + done, static_cast<size_t>(row_bytes - done)};
    const ssize_t got = preadv2(fd, &io, 1, at + done, flags);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    done += got;
  }
  return true;
}

}  // namespace

// Reads row ids[j] (row_bytes each, the matrix at `offset`, n_rows rows) into out + j * row_bytes
// for j < count. Returns -1 when every row was read, else the first j whose id is out of range
// or whose read came up short (the file changed or shrank under the runtime).
extern "C" int64_t read_rows_cpu(int fd, int64_t offset, int64_t row_bytes, int64_t n_rows, const int64_t *ids,
                                 int64_t count, uint8_t *out) {
  for (int64_t j = 0; j < count; ++j)
    if (ids[j] < 0 || ids[j] >= n_rows) return j;
  std::vector<int64_t> done(count, 0);
  std::vector<uint8_t> cached(count);
  // Both passes on every thread: a read from the page cache is mostly the system call's own
  // cost, and the GEMVs have just left the other core idle.
#pragma omp parallel for schedule(static) if (count >= kParallelRows)
  for (int64_t j = 0; j < count; ++j)
    // EAGAIN (not cached), or a kernel or file system without RWF_NOWAIT: read it in pass two.
    cached[j] = read_rest(fd, out + j * row_bytes, row_bytes, offset + ids[j] * row_bytes, done[j], RWF_NOWAIT);
  std::vector<int64_t> missing;
  for (int64_t j = 0; j < count; ++j)
    if (!cached[j]) missing.push_back(j);
  const int64_t n_missing = static_cast<int64_t>(missing.size());
  if (n_missing > 1)
    for (const int64_t j : missing)
      posix_fadvise(fd, offset + ids[j] * row_bytes + done[j], row_bytes - done[j], POSIX_FADV_WILLNEED);
  int64_t failed = count;
#pragma omp parallel for schedule(static) reduction(min : failed) if (n_missing >= kParallelRows)
  for (int64_t m = 0; m < n_missing; ++m) {
    const int64_t j = missing[m];
    if (!read_rest(fd, out + j * row_bytes, row_bytes, offset + ids[j] * row_bytes, done[j], 0) && j < failed)
      failed = j;
  }
  return failed < count ? failed : -1;
}

// The ids of the k largest of x[0..n) (k <= n), in no particular order, into ids. Of equal
// values the lower id ranks first, so the set is the same on every run and every class. NaN
// is never chosen. The candidates of a 4-bit head's rescoring (llama_runtime/head_rescore.py):
// one scan against the running k-th value keeps a few thousand of the 128 256 logits, where
// torch.topk took about 0.25 ms of a decode step.
extern "C" void top_k_ids_cpu(const float *x, int64_t n, int64_t k, int64_t *ids) {
  struct Item {
    float v;
    int64_t i;
  };
  const auto before = [](const Item &a, const Item &b) { return a.v > b.v || (a.v == b.v && a.i < b.i); };
  const size_t cap = static_cast<size_t>(std::max<int64_t>(8 * k, 1024));
  std::vector<Item> kept;
  kept.reserve(cap);
  // Below the running k-th value nothing can enter; at it, a later id ranks after every kept one.
  float floor = -__builtin_inff();
  bool have_floor = false;
  const auto prune = [&] {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
    kept.resize(k);
    floor = kept[k - 1].v;   // the lowest kept: nth_element put every higher-ranked one before it
    have_floor = true;
  };
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (v != v) continue;
    if (!have_floor || v > floor) {
      kept.push_back({v, i});
      if (kept.size() == cap) prune();
    }
  }
  if (static_cast<int64_t>(kept.size()) > k) prune();
  for (int64_t j = 0; j < k; ++j) ids[j] = j < static_cast<int64_t>(kept.size()) ? kept[j].i : -1;
}
