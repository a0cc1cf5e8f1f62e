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
#include <cstring>
#include <vector>

#include "simd_bf16.h"

namespace {

// Fewer rows than this (an embedding lookup's one) are read on the calling thread alone.
constexpr int64_t kParallelRows = 32;
// top_k_ids_cpu: values tested against the bound together, and the sample its bound comes from.
constexpr int64_t kScanBlock = native::kWidth;
constexpr int64_t kSample = 1024;
constexpr int64_t kMaxSampleRank = 64;
// rescore_rows_cpu's answer when fewer logits than candidates are not NaN (native_cpu.py's
// RESCORE_TOO_FEW).
constexpr int64_t kTooFew = -2;

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

// The rows at positions js of ids, read into out + j * row_bytes in the two passes above: -1
// when every one was read, else the first j whose read came up short.
int64_t read_at(int fd, int64_t offset, int64_t row_bytes, const int64_t *ids, const std::vector<int64_t> &js,
                uint8_t *out) {
  const int64_t count = static_cast<int64_t>(js.size());
  std::vector<int64_t> done(count, 0);
  std::vector<uint8_t> cached(count);
  // Both passes on every thread: a read from the page cache is mostly the system call's own
  // cost, and the GEMVs have just left the other core idle.
#pragma omp parallel for schedule(static) if (count >= kParallelRows)
  for (int64_t m = 0; m < count; ++m)
    // EAGAIN (not cached), or a kernel or file system without RWF_NOWAIT: read it in pass two.
    cached[m] = read_rest(fd, out + js[m] * row_bytes, row_bytes, offset + ids[js[m]] * row_bytes, done[m], RWF_NOWAIT);
  std::vector<int64_t> missing;
  for (int64_t m = 0; m < count; ++m)
    if (!cached[m]) missing.push_back(m);
  const int64_t n_missing = static_cast<int64_t>(missing.size());
  if (n_missing > 1)
    for (const int64_t m : missing)
      posix_fadvise(fd, offset + ids[js[m]] * row_bytes + done[m], row_bytes - done[m], POSIX_FADV_WILLNEED);
  int64_t failed = INT64_MAX;
#pragma omp parallel for schedule(static) reduction(min : failed) if (n_missing >= kParallelRows)
  for (int64_t i = 0; i < n_missing; ++i) {
    const int64_t m = missing[i], j = js[m];
    if (!read_rest(fd, out + j * row_bytes, row_bytes, offset + ids[j] * row_bytes, done[m], 0) && j < failed)
      failed = j;
  }
  return failed == INT64_MAX ? -1 : failed;
}

// Rows copied between two buffers, pairs (row in `to`, row in `from`), on both threads for many.
void copy_rows(uint8_t *to, const std::vector<int64_t> &to_row, const uint8_t *from, const std::vector<int64_t> &from_row,
               int64_t row_bytes) {
  const int64_t count = static_cast<int64_t>(to_row.size());
#pragma omp parallel for schedule(static) if (count >= kParallelRows)
  for (int64_t m = 0; m < count; ++m)
    std::memcpy(to + to_row[m] * row_bytes, from + from_row[m] * row_bytes, row_bytes);
}

int64_t out_of_range(const int64_t *ids, int64_t count, int64_t n_rows) {
  for (int64_t j = 0; j < count; ++j)
    if (ids[j] < 0 || ids[j] >= n_rows) return j;
  return -1;
}

}  // namespace

// Reads row ids[j] (row_bytes each, the matrix at `offset`, n_rows rows) into out + j * row_bytes
// for j < count. Returns -1 when every row was read, else the first j whose id is out of range
// or whose read came up short (the file changed or shrank under the runtime).
extern "C" int64_t read_rows_cpu(int fd, int64_t offset, int64_t row_bytes, int64_t n_rows, const int64_t *ids,
                                 int64_t count, uint8_t *out) {
  const int64_t bad = out_of_range(ids, count, n_rows);
  if (bad >= 0) return bad;
  std::vector<int64_t> js(count);
  for (int64_t j = 0; j < count; ++j) js[j] = j;
  return read_at(fd, offset, row_bytes, ids, js, out);
}

// read_rows_cpu through a cache of `capacity` rows (FileRows' row cache): slot_of[id] is the
// slot holding row id or -1, id_of[slot] the row a slot holds or -1, `data` the slots' bytes.
// A rescoring's candidates recur from token to token on a trained model (on SmolLM2, the
// runtime's 16 MiB held 90 % of them), and a cached row is a copy instead of a system call.
// Slots are reused in CLOCK order: the hand skips, once, a slot used since it last passed
// (used[slot] 1). A call never evicts a row it cached itself (used 2 while it runs): past
// `capacity` new rows, the rest are read but not kept.
extern "C" int64_t read_rows_cached_cpu(int fd, int64_t offset, int64_t row_bytes, int64_t n_rows, const int64_t *ids,
                                        int64_t count, uint8_t *out, int32_t *slot_of, int64_t *id_of, uint8_t *used,
                                        uint8_t *data, int64_t capacity, int64_t *hand) {
  const int64_t bad = out_of_range(ids, count, n_rows);
  if (bad >= 0) return bad;
  std::vector<int64_t> hit_j, hit_slot, miss;
  for (int64_t j = 0; j < count; ++j) {
    const int32_t slot = slot_of[ids[j]];
    if (slot < 0) {
      miss.push_back(j);
    } else {
      used[slot] = 1;
      hit_j.push_back(j);
      hit_slot.push_back(slot);
    }
  }
  copy_rows(out, hit_j, data, hit_slot, row_bytes);
  const int64_t failed = read_at(fd, offset, row_bytes, ids, miss, out);
  if (failed >= 0) return failed;
  std::vector<int64_t> put_slot, put_j;
  for (const int64_t j : miss) {
    if (slot_of[ids[j]] >= 0) continue;          // the same id twice in one call
    while (used[*hand] == 1) {
      used[*hand] = 0;
      *hand = (*hand + 1) % capacity;
    }
    if (used[*hand] == 2) break;                 // every slot holds a row of this call
    const int64_t slot = *hand;
    *hand = (slot + 1) % capacity;
    if (id_of[slot] >= 0) slot_of[id_of[slot]] = -1;
    id_of[slot] = ids[j];
    slot_of[ids[j]] = static_cast<int32_t>(slot);
    used[slot] = 2;
    put_slot.push_back(slot);
    put_j.push_back(j);
  }
  for (const int64_t slot : put_slot) used[slot] = 1;
  copy_rows(data, put_slot, out, put_j, row_bytes);
  return -1;
}

// The ids of the k largest of x[0..n) (k <= n), in no particular order, into ids. Of equal
// values the lower id ranks first, so the set is the same on every run and every class. NaN
// is never chosen; ids[k - 1] is -1 when fewer than k values are not NaN. The candidates of a
// 4-bit head's rescoring (llama_runtime/head_rescore.py), where torch.topk took about 0.25 ms
// of a decode step.
//
// One scan keeps the values at or above a lower bound, against a running k-th value once k of
// them are kept. The bound comes from a sample of the values (kSample, evenly spaced): the
// value of its rank that about 3k of the n values pass. If fewer than k pass (the sample
// was unlucky, or the values are few), the scan is repeated with no bound, so the result never
// depends on the sample. Most blocks of kScanBlock values then hold none to keep, and one
// vector comparison skips them; without the bound, the running value rose in a few rounds of
// nth_element over thousands of kept values, which cost more than the scan.
extern "C" void top_k_ids_cpu(const float *x, int64_t n, int64_t k, int64_t *ids) {
  struct Item {
    float v;
    int64_t i;
  };
  const auto before = [](const Item &a, const Item &b) { return a.v > b.v || (a.v == b.v && a.i < b.i); };
  const size_t cap = static_cast<size_t>(std::max<int64_t>(8 * k, 1024));
  std::vector<Item> kept;
  kept.reserve(cap);
  float floor = 0.0f;
  bool have_floor = false;
  const auto prune = [&] {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
    kept.resize(k);
    floor = kept[k - 1].v;   // the lowest kept: nth_element put every higher-ranked one before it
    have_floor = true;
  };
  // Below `lower`, or below the running k-th value, nothing enters; at the k-th value, a later
  // id ranks after every kept one. True when at least k values were at or above `lower`.
  const auto scan = [&](float lower) {
    kept.clear();
    have_floor = false;
    const auto consider = [&](int64_t i) {
      const float v = x[i];
      if (v >= lower && (!have_floor || v > floor)) {   // NaN fails both
        kept.push_back({v, i});
        if (kept.size() == cap) prune();
      }
    };
    // One vector comparison a block: written as a scalar loop, GCC vectorized it across
    // blocks, transposing them through the stack, and the scan took most of the call.
    int64_t i = 0;
    native::F16 bar = native::set1(lower);
    for (; i + kScanBlock <= n; i += kScanBlock) {
      if (!native::any_at_least(native::load_f32(x + i), bar)) continue;
      for (int64_t j = 0; j < kScanBlock; ++j) consider(i + j);
      if (have_floor) bar = native::set1(floor);
    }
    for (; i < n; ++i) consider(i);
    if (static_cast<int64_t>(kept.size()) > k) prune();
    return static_cast<int64_t>(kept.size()) == k;
  };
  bool done = false;
  const int64_t rank = (3 * k * kSample + n - 1) / n;   // about 3k of the n values at or above it
  if (n >= 4 * kSample && rank <= kMaxSampleRank) {
    std::vector<float> top(rank);   // the sample's largest, descending
    int64_t have = 0;
    for (int64_t s = 0; s < kSample; ++s) {
      const float v = x[s * (n / kSample)];
      if (v != v || (have == rank && !(v > top[have - 1]))) continue;
      int64_t at = have < rank ? have++ : have - 1;
      for (; at > 0 && top[at - 1] < v; --at) top[at] = top[at - 1];
      top[at] = v;
    }
    if (have == rank) done = scan(top[rank - 1]);
  }
  if (!done) scan(-__builtin_inff());
  for (int64_t j = 0; j < k; ++j) ids[j] = j < static_cast<int64_t>(kept.size()) ? kept[j].i : -1;
}

// out[j] = rows[j] · x in f32, for the count rows (bf16, k wide) a rescoring has just read
// (read_rows_cpu). Each thread takes the rows its read left in its own cache (the same static
// split), one vector of partial sums a row (simd_bf16.h): torch's f32 matmul over the same rows
// first converted them to a 2 MiB f32 copy, about 0.1 ms of a decode step.
extern "C" void rows_dot_bf16_cpu(const uint16_t *rows, int64_t count, int64_t k, const uint16_t *x, float *out) {
#pragma omp parallel for schedule(static) if (count >= kParallelRows)
  for (int64_t j = 0; j < count; ++j) {
    const uint16_t *r = rows + j * k;
    native::F16 acc = native::zero();
    for (int64_t c = 0; c < k; c += native::kWidth)
      acc = native::fma(native::load_bf16(r + c, k - c), native::load_bf16(x + c, k - c), acc);
    out[j] = native::reduce_add(acc);
  }
}

// A 4-bit head's rescoring (llama_runtime/head_rescore.py) in one call: the ids of the k
// largest logits (top_k_ids_cpu) into ids, their bf16 rows (`width` values) read from the
// file (read_rows_cached_cpu where slot_of is given, else read_rows_cpu) into `rows`, and each
// of those logits overwritten with its row · x (rows_dot_bf16_cpu) rounded to bf16. Made from
// Python as three calls with tensors between them, the steps took about twice their native
// time. Returns -1 when done; kTooFew, with nothing changed, when fewer than k logits are not
// NaN; else the first position j whose row could not be read (ids[j] is its id), the logits
// unchanged.
//
// Where `source` is given, the logits are first its n bf16 values widened (the head's output as
// the device left it; that much is done whatever the return): in Python, torch's widening into
// a new tensor took 0.15-0.2 ms of a Llama-3.2-1B step, run from caches the head's 164 MB had
// just flushed, where this pass takes a few tens of microseconds.
extern "C" int64_t rescore_rows_cpu(const uint16_t *source, float *logits, int64_t n, int64_t k, const uint16_t *x,
                                    int64_t width, int fd, int64_t offset, int64_t n_rows, int64_t *ids,
                                    uint16_t *rows, int32_t *slot_of, int64_t *id_of, uint8_t *used, uint8_t *data,
                                    int64_t capacity, int64_t *hand) {
  if (source != nullptr)
    for (int64_t i = 0; i < n; i += native::kWidth)
      native::store_f32(logits + i, native::load_bf16(source + i, n - i), n - i);
  top_k_ids_cpu(logits, n, k, ids);
  if (ids[k - 1] < 0) return kTooFew;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(uint16_t));
  uint8_t *out = reinterpret_cast<uint8_t *>(rows);
  const int64_t failed =
      slot_of != nullptr
          ? read_rows_cached_cpu(fd, offset, row_bytes, n_rows, ids, k, out, slot_of, id_of, used, data, capacity, hand)
          : read_rows_cpu(fd, offset, row_bytes, n_rows, ids, k, out);
  if (failed >= 0) return failed;
  std::vector<float> exact(k);
  std::vector<uint16_t> rounded(k);
  rows_dot_bf16_cpu(rows, k, width, x, exact.data());
  // Rounded by the kernels' own store (simd_bf16.h), then widened back to f32 exactly.
  for (int64_t j = 0; j < k; j += native::kWidth)
    native::store_bf16(rounded.data() + j, native::load_f32(exact.data() + j, k - j), k - j);
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t bits = static_cast<uint32_t>(rounded[j]) << 16;
    std::memcpy(logits + ids[j], &bits, sizeof bits);
  }
  return -1;
}
