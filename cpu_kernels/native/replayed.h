// The entry points a native program may replay (program_cpu.cc), declared once.
//
// A recorded decode token is a table of these calls with their arguments as int64 words; the
// replay has to call each with the C types its definition takes, and Python has to pass the
// same types when it calls one directly. Both follow from these prototypes: each kernel's
// source includes this header, so a definition that parts from its prototype does not
// compile, and program_cpu.cc derives from the prototypes both its calls and the argument
// kinds it tells Python (`native_program_signature`), from which `native_cpu` sets the
// functions' ctypes `argtypes`.
#pragma once

#include <cstdint>

extern "C" {

// A byte copy: the sync of a buffer's range, or an activation handed on to the next call.
void native_program_copy(void *dst, const void *src, int64_t n);

void rmsnorm_bf16_cpu(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim, float eps);
void swiglu_bf16_cpu(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n);
void add_bf16_cpu(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n);
void rope_bf16_cpu(const uint16_t *x, const uint16_t *lut, uint16_t *out, int64_t rows, int64_t heads,
                   int64_t head_dim);
void gemv_packed_bf16_cpu_batch(const int64_t *desc, int count);
void gemv_q4nx_cpu_batch(const int64_t *desc, int count);
void gemm_packed_bf16_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n, int64_t k);
void gemm_q4nx_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n, int64_t k);
void gemm_q4nx_int_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n, int64_t k);
void kv_store_row_bf16_cpu(const uint16_t *k_row, const uint16_t *v_row, uint16_t *k_at, uint16_t *v_at,
                           int64_t kv_heads, int64_t d, int64_t stride);
void attention_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t heads,
                        int64_t kv_heads, int64_t d, int64_t n, int64_t stride);
// The host attention over a resident cache, its position read through `pos` (attention_bf16_cpu.cc).
void attention_at_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, const int32_t *pos,
                           const int64_t *shape, int32_t *status);
// The resident KV cache's (resident_kv_bf16_cpu.cc): each reads its position through `start` /
// `pos` when it runs, so a recorded call needs no step a position; `shape` and `status` are
// words the bound call holds.
void kv_append_bf16_cpu(const uint16_t *k, const uint16_t *v, const int32_t *start, uint16_t *k_cache,
                        uint16_t *v_cache, const int64_t *shape, int32_t *status);
void decode_attn_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *pos, float *acc,
                          float *stats, const int64_t *shape, int32_t *status);
void attn_merge_bf16_cpu(const float *acc, const float *stats, uint16_t *out, int64_t kv_heads, int64_t splits,
                         int64_t group, int64_t d);

}  // extern "C"
