// Rows of a matrix in a file, read at token ids: the host's embedding lookups and a 4-bit
// head's rescored candidates (llama_runtime/safetensors_io.FileRows). A few hundred rows a
// token, each its own pread: one Python call for all of them keeps the interpreter's
// per-call cost (about 4 µs a row) out of every decode step.
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

#include <cerrno>
#include <cstdint>
#include <vector>

namespace {

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
  std::vector<int64_t> missing, done(count, 0);
  for (int64_t j = 0; j < count; ++j) {
    // EAGAIN (not cached), or a kernel or file system without RWF_NOWAIT: read it in pass two.
    if (!read_rest(fd, out + j * row_bytes, row_bytes, offset + ids[j] * row_bytes, done[j], RWF_NOWAIT))
      missing.push_back(j);
  }
  if (missing.size() > 1)
    for (const int64_t j : missing)
      posix_fadvise(fd, offset + ids[j] * row_bytes + done[j], row_bytes - done[j], POSIX_FADV_WILLNEED);
  for (const int64_t j : missing)
    if (!read_rest(fd, out + j * row_bytes, row_bytes, offset + ids[j] * row_bytes, done[j], 0)) return j;
  return -1;
}
