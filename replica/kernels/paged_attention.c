/* Paged attention for rows of few query tokens (decode, chain verify) on CPU.
 *
 * Reads keys and values where they lie in the paged KV pool, so a decode step does not copy
 * every request's context into a padded tensor before attending (that copy was half of a
 * batch-32 decode step). Layout of one layer's pool: rows of [kv_heads, head_dim], block b
 * holding keys in rows b*2*bs .. b*2*bs+bs-1 and values in the next bs rows.
 *
 * block_size must be a power of two.
 *
 * Query token i (0-based among the request's q_len new tokens) attends causally to positions
 * 0 .. num_cached + i. A work item is one (request, kv head): every query head of its GQA group
 * and every query token of the request use each key and value row while it is in L1, so a
 * verify row of k+1 tokens costs little more than a decode row. Scores, a numerically stable
 * softmax and the weighted sum of values are computed in fp32.
 *
 * Built with -ffast-math, which vectorizes expf and the dot-product reductions (about 1.6x on
 * the demo target's heads); the code therefore never relies on infinities or NaNs: the
 * softmax maximum starts from the first score, and every query sees at least one key.
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

/* The body is inlined once per common head_dim, so the inner loops have constant trip counts
 * and compile to straight vector code (a runtime head_dim cost ~2x in the dot products). */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                    \
    static inline __attribute__((always_inline)) int NAME##_body(                              \
        const T *q, const T *pool, const int32_t *tables, int64_t table_stride,               \
        const int32_t *q_start, const int32_t *q_len, const int32_t *num_cached,              \
        int64_t num_requests, int64_t heads, int64_t kv_heads, const int64_t head_dim,        \
        int64_t block_size, float scale, T *out, int64_t threads) {                           \
        const int64_t group = heads / kv_heads;                                                \
        const int64_t row = kv_heads * head_dim;                                               \
        /* block_size is a power of two: shifts, not divisions, in the per-key loops */         \
        int shift = 0;                                                                         \
        while (((int64_t)1 << shift) < block_size) shift++;                                    \
        const int64_t mask = block_size - 1;                                                   \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                  \
        for (int64_t item = 0; item < num_requests * kv_heads; item++) {                       \
            const int64_t r = item / kv_heads, kvh = item % kv_heads;                          \
            const int32_t *table = tables + r * table_stride;                                  \
            const int64_t n_q = q_len[r], cached = num_cached[r], ctx = cached + n_q;          \
            const int64_t n = n_q * group; /* query vectors: token-major, then head */         \
            float *buf = malloc(sizeof(float) * (size_t)(n * (ctx + 2 * head_dim)));           \
            if (buf == NULL) {                                                                 \
                _Pragma("omp atomic write")                                                    \
                failed = 1;                                                                    \
                continue;                                                                      \
            }                                                                                  \
            float *scores = buf, *qf = buf + n * ctx, *acc = qf + n * head_dim;                \
            for (int64_t i = 0; i < n_q; i++)                                                  \
                for (int64_t g = 0; g < group; g++) {                                          \
                    const T *src = q + (((int64_t)q_start[r] + i) * heads + kvh * group + g) * \
                                           head_dim;                                           \
                    float *dst = qf + (i * group + g) * head_dim;                              \
                    for (int64_t d = 0; d < head_dim; d++) dst[d] = LOAD(src[d]) * scale;      \
                }                                                                              \
            /* query vector v (token v / group, head kvh * group + v % group) sees keys            \
             * 0 .. cached + v / group; one vector at a time keeps its accumulators in             \
             * registers while the rows it reads stay in cache for the next vector */              \
            for (int64_t v = 0; v < n; v++) {                                                      \
                const int64_t seen = cached + v / group + 1;                                       \
                const float *qv = qf + v * head_dim;                                               \
                float *s = scores + v * ctx;                                                       \
                for (int64_t j = 0; j < seen; j++) {                                               \
                    const T *k = pool + (((int64_t)table[j >> shift] << (shift + 1)) +             \
                                         (j & mask)) * row + kvh * head_dim;                       \
                    float dot = 0.0f;                                                              \
                    _Pragma("omp simd reduction(+ : dot)")                                         \
                    for (int64_t d = 0; d < head_dim; d++) dot += qv[d] * LOAD(k[d]);              \
                    s[j] = dot;                                                                    \
                }                                                                                  \
                float top = s[0], total = 0.0f;                                                    \
                for (int64_t j = 1; j < seen; j++) top = s[j] > top ? s[j] : top;                  \
                for (int64_t j = 0; j < seen; j++) {                                               \
                    s[j] = expf(s[j] - top);                                                       \
                    total += s[j];                                                                 \
                }                                                                                  \
                float *a = acc + v * head_dim;                                                     \
                for (int64_t d = 0; d < head_dim; d++) a[d] = 0.0f;                                \
                for (int64_t j = 0; j < seen; j++) {                                               \
                    const T *val = pool + (((int64_t)table[j >> shift] << (shift + 1)) +           \
                                           block_size + (j & mask)) * row + kvh * head_dim;        \
                    const float p = s[j];                                                          \
                    _Pragma("omp simd")                                                            \
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * LOAD(val[d]);               \
                }                                                                                  \
                T *dst = out + (((int64_t)q_start[r] + v / group) * heads + kvh * group +          \
                                v % group) * head_dim;                                             \
                const float inv = 1.0f / total;                                                    \
                for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(a[d] * inv);                 \
            }                                                                                      \
            free(buf);                                                                         \
        }                                                                                      \
        return failed;                                                                         \
    }                                                                                          \
    int NAME(const T *q, const T *pool, const int32_t *tables, int64_t table_stride,          \
             const int32_t *q_start, const int32_t *q_len, const int32_t *num_cached,         \
             int64_t num_requests, int64_t heads, int64_t kv_heads, int64_t head_dim,         \
             int64_t block_size, float scale, T *out, int64_t threads) {                      \
        switch (head_dim) {                                                                    \
        case 32:                                                                               \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,      \
                               num_requests, heads, kv_heads, 32, block_size, scale, out,      \
                               threads);                                                       \
        case 64:                                                                               \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,      \
                               num_requests, heads, kv_heads, 64, block_size, scale, out,      \
                               threads);                                                       \
        case 128:                                                                              \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,      \
                               num_requests, heads, kv_heads, 128, block_size, scale, out,     \
                               threads);                                                       \
        default:                                                                               \
            return NAME##_body(q, pool, tables, table_stride, q_start, q_len, num_cached,      \
                               num_requests, heads, kv_heads, head_dim, block_size, scale,     \
                               out, threads);                                                  \
        }                                                                                      \
    }

#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_attention_f32, float, IDENTITY, IDENTITY)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, bf16_to_float, float_to_bf16)
