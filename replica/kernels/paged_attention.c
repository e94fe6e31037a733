/* Paged attention for rows of few query tokens (decode, chain and tree verify) on CPU.
 *
 * Reads keys and values where they lie in the paged KV pool, so a decode step does not copy
 * every request's context into a padded tensor before attending (that copy was half of a
 * batch-32 decode step). Layout of one layer's pool: rows of [kv_heads, head_dim], block b
 * holding keys in rows b*2*bs .. b*2*bs+bs-1 and values in the next bs rows.
 *
 * block_size must be a power of two.
 *
 * Query token i (0-based among the request's q_len new tokens) attends causally to positions
 * 0 .. num_cached + i, or, with `masks` (token trees), to the keys its bits allow: positions
 * before mask_from[r] and mask_from[r] + b for each bit b set in masks[q_start[r] + i]. A
 * work item is one (request, kv head): every query head of its GQA group and every query
 * token of the request use each key and value row while it is in L1, so a verify row of k+1
 * tokens costs little more than a decode row. Scores, a numerically stable
 * softmax and the weighted sum of values are computed in fp32.
 *
 * attend_one.h handles one work item, so that decode_forward.c runs the same attention inside
 * its own parallel region; paged_attention_* are the stand-alone entry points.
 *
 * Built with -ffast-math, which vectorizes expf and the dot-product reductions (about 1.6x on
 * the demo target's heads); the code therefore never relies on infinities or NaNs: the
 * softmax maximum starts from a score the query sees (the first, or under a tree mask its own
 * key's, which every mask shows: cpu_kernels.mask_bits refuses one that hides it), and masked
 * keys weigh zero.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline int log2_block(int64_t block_size) {
    int shift = 0;
    while (((int64_t)1 << shift) < block_size) shift++;
    return shift;
}

#define DEFINE_KERNEL(NAME, T, ATTEND)                                                        \
    static inline __attribute__((always_inline)) int NAME##_body(                             \
        const T *q, const T *pool, const int64_t *tables, int64_t table_stride,              \
        const int64_t *q_start, const int64_t *q_len, const int64_t *num_cached,             \
        const int64_t *mask_from, const uint64_t *masks, int64_t num_requests, int64_t heads, \
        int64_t kv_heads, const int64_t head_dim, int64_t block_size, float scale, T *out,   \
        int64_t threads) {                                                                    \
        const int shift = log2_block(block_size);                                             \
        int failed = 0;                                                                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                 \
        for (int64_t item = 0; item < num_requests * kv_heads; item++) {                      \
            const int64_t r = item / kv_heads, kvh = item % kv_heads;                         \
            if (ATTEND(q, heads * head_dim, pool, tables + r * table_stride, q_start[r],      \
                       q_len[r], num_cached[r], masks ? mask_from[r] : 0,                     \
                       masks ? masks + q_start[r] : NULL, kvh, heads, kv_heads, head_dim,     \
                       shift, scale, out)) {                                                  \
                _Pragma("omp atomic write")                                                   \
                failed = 1;                                                                   \
            }                                                                                 \
        }                                                                                     \
        return failed;                                                                        \
    }                                                                                         \
    int NAME(const T *q, const T *pool, const int64_t *tables, int64_t table_stride,         \
             const int64_t *q_start, const int64_t *q_len, const int64_t *num_cached,        \
             const int64_t *mask_from, const uint64_t *masks, int64_t num_requests,          \
             int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,          \
             float scale, T *out, int64_t threads) {                                         \
        switch (head_dim) {                                                                   \
        case 32:                                                                              \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,     \
                               mask_from, masks, num_requests, heads, kv_heads, 32,           \
                               block_size, scale, out, threads);                              \
        case 64:                                                                              \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,     \
                               mask_from, masks, num_requests, heads, kv_heads, 64,           \
                               block_size, scale, out, threads);                              \
        case 128:                                                                             \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,     \
                               mask_from, masks, num_requests, heads, kv_heads, 128,          \
                               block_size, scale, out, threads);                              \
        default:                                                                              \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,     \
                               mask_from, masks, num_requests, heads, kv_heads, head_dim,     \
                               block_size, scale, out, threads);                              \
        }                                                                                     \
    }

#define IDENTITY(x) (x)

#define ATTEND_NAME attend_one_f32
#define TQ float
#define LOADQ IDENTITY
#define TKV float
#define LOADKV IDENTITY
#define TO float
#define STORE IDENTITY
#include "attend_one.h"

#define ATTEND_NAME attend_one_bf16
#define TQ uint16_t
#define LOADQ bf16_to_float
#define TKV uint16_t
#define LOADKV bf16_to_float
#define TO uint16_t
#define STORE float_to_bf16
#include "attend_one.h"

DEFINE_KERNEL(paged_attention_f32, float, attend_one_f32)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, attend_one_bf16)
