// Rows of a matrix in a file, read at token ids: the host's embedding lookups and a 4-bit
// head's rescored candidates (llama_runtime/safetensors_io.FileRows). A few hundred rows a
// token, each its own pread: one Python call for all of them keeps the interpreter's
// per-call cost (about 4 µs a row) out of every decode step.

#include <unistd.h>

#include <cerrno>
#include <cstdint>

// Reads row ids[j] (row_bytes each, the matrix at `offset`, n_rows rows) into out + j * row_bytes
// for j < count. Returns -1 when every row was read, else the first j whose id is out of range
// or whose read came up short (the file changed or shrank under the runtime).
extern "C" int64_t read_rows_cpu(int fd, int64_t offset, int64_t row_bytes, int64_t n_rows, const int64_t *ids,
                                 int64_t count, uint8_t *out) {
  for (int64_t j = 0; j < count; ++j) {
    if (ids[j] < 0 || ids[j] >= n_rows) return j;
    uint8_t *dst = out + j * row_bytes;
    int64_t done = 0;
    while (done < row_bytes) {
      const ssize_t got = pread(fd, dst + done, row_bytes - done, offset + ids[j] * row_bytes + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return j;
      done += got;
    }
  }
  return -1;
}
