/* One work item of paged attention, written once for every element type: included with
 * ATTEND_NAME, TQ / LOADQ (queries), TKV / LOADKV (the pool) and TO / STORE (the output)
 * defined; it undefines them at its end, so every inclusion states its own.
 *
 * The item is every query head of kv head `kvh` for the n_q new tokens of one request whose
 * queries are rows q_row0 .. q_row0 + n_q - 1 of q (q_stride elements apart, heads x head_dim
 * each); it writes rows of out (heads x head_dim each) and returns 1 if its buffer failed.
 * Without `masks` the tokens attend causally; with them (a token tree), new token i sees keys
 * before `mask_from` and key mask_from + b where bit b of masks[i] is set (every key it sees
 * lies below cached + n_q, its own among them).
 * Always inlined into a caller whose head_dim is a constant, so the inner loops have constant
 * trip counts and compile to straight vector code (a runtime head_dim cost ~2x in the dot
 * products). Scores take four keys at a time and the weighted sum two values at a time, so the
 * multiply-adds form independent chains instead of waiting on each other's latency. */
static inline __attribute__((always_inline)) int ATTEND_NAME(
    const TQ *q, int64_t q_stride, const TKV *pool, const int64_t *table, int64_t q_row0,
    int64_t n_q, int64_t cached, int64_t mask_from, const uint64_t *masks, int64_t kvh,
    int64_t heads, int64_t kv_heads, const int64_t head_dim, int shift, float scale, TO *out) {
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * head_dim;
    const int64_t block_size = (int64_t)1 << shift, mask = block_size - 1;
    const int64_t ctx = cached + n_q;
    const int64_t n = n_q * group; /* query vectors: token-major, then head */
    float *buf = malloc(sizeof(float) * (size_t)(n * (ctx + head_dim)));
    if (buf == NULL) return 1;
    float *scores = buf, *qf = buf + n * ctx;
    for (int64_t i = 0; i < n_q; i++)
        for (int64_t g = 0; g < group; g++) {
            const TQ *src = q + (q_row0 + i) * q_stride + (kvh * group + g) * head_dim;
            float *dst = qf + (i * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = LOADQ(src[d]) * scale;
        }
    /* query vector v (token v / group, head kvh * group + v % group) sees keys 0 .. cached +
     * v / group (causal; a tree scores keys up to cached + n_q - 1 and weighs the hidden ones
     * zero); one vector at a time keeps its accumulators in registers while the rows it
     * reads stay in cache for the next vector. Keys j .. j + 3 (j a multiple of 4) lie in one
     * block, in consecutive rows. */
    for (int64_t v = 0; v < n; v++) {
        const int64_t seen = masks ? ctx : cached + v / group + 1;
        const float *qv = qf + v * head_dim;
        float *s = scores + v * ctx;
        int64_t j = 0;
        for (; j + 4 <= seen; j += 4) {
            const TKV *k0 =
                pool + (((int64_t)table[j >> shift] << (shift + 1)) + (j & mask)) * row +
                kvh * head_dim;
            if (v == 0 && (j & mask) == 0 && j + block_size < seen) {
                /* the next block's keys and values: rows of one head are far apart */
                const TKV *next = pool + ((int64_t)table[(j >> shift) + 1] << (shift + 1)) * row +
                                  kvh * head_dim;
                for (int64_t i = 0; i < 2 * block_size; i++)
                    for (int64_t d = 0; d < head_dim; d += 64 / (int64_t)sizeof(TKV))
                        __builtin_prefetch(next + i * row + d);
            }
            const TKV *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t d = 0; d < head_dim; d++) {
                d0 += qv[d] * LOADKV(k0[d]);
                d1 += qv[d] * LOADKV(k1[d]);
                d2 += qv[d] * LOADKV(k2[d]);
                d3 += qv[d] * LOADKV(k3[d]);
            }
            s[j] = d0;
            s[j + 1] = d1;
            s[j + 2] = d2;
            s[j + 3] = d3;
        }
        for (; j < seen; j++) {
            const TKV *k = pool + (((int64_t)table[j >> shift] << (shift + 1)) + (j & mask)) * row +
                           kvh * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; d++) dot += qv[d] * LOADKV(k[d]);
            s[j] = dot;
        }
        float total = 0.0f;
        if (masks) {
            const uint64_t bits = masks[v / group];
            /* its own key is always seen, so the maximum starts from a visible score */
            float top = s[cached + v / group];
            for (int64_t i = 0; i < seen; i++)
                if (i < mask_from || (bits >> (i - mask_from)) & 1) top = s[i] > top ? s[i] : top;
            for (int64_t i = 0; i < seen; i++) {
                s[i] = i < mask_from || (bits >> (i - mask_from)) & 1 ? expf(s[i] - top) : 0.0f;
                total += s[i];
            }
        } else {
            float top = s[0];
            for (int64_t i = 1; i < seen; i++) top = s[i] > top ? s[i] : top;
            for (int64_t i = 0; i < seen; i++) {
                s[i] = expf(s[i] - top);
                total += s[i];
            }
        }
        float a0[head_dim], a1[head_dim];
        for (int64_t d = 0; d < head_dim; d++) a0[d] = a1[d] = 0.0f;
        for (j = 0; j + 2 <= seen; j += 2) {
            const TKV *v0 = pool +
                            (((int64_t)table[j >> shift] << (shift + 1)) + block_size + (j & mask)) *
                                row +
                            kvh * head_dim;
            const TKV *v1 = v0 + row;
            const float p0 = s[j], p1 = s[j + 1];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                a0[d] += p0 * LOADKV(v0[d]);
                a1[d] += p1 * LOADKV(v1[d]);
            }
        }
        if (j < seen) {
            const TKV *v0 = pool +
                            (((int64_t)table[j >> shift] << (shift + 1)) + block_size + (j & mask)) *
                                row +
                            kvh * head_dim;
            const float p0 = s[j];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) a0[d] += p0 * LOADKV(v0[d]);
        }
        TO *dst = out + ((q_row0 + v / group) * heads + kvh * group + v % group) * head_dim;
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE((a0[d] + a1[d]) * inv);
    }
    free(buf);
    return 0;
}

#undef ATTEND_NAME
#undef TQ
#undef LOADQ
#undef TKV
#undef LOADKV
#undef TO
#undef STORE
