/* The fused forward for one weight type; included by decode_forward.c with T (weight and pool
 * element), LOAD / STORE (to and from fp32), SUFFIX (f32 or bf16) and ATTEND defined.
 *
 * Matrix products read their inputs as XT: fp32, or with bf16 weights on a CPU with AVX512-BF16
 * the activations rounded to bf16 (as PyTorch's bf16 path keeps them), so that one vdpbf16ps
 * multiplies 32 weight and input pairs with no widening of the weights. */
#if LOAD_IS_BF16 && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define DOT_BF16 1
#define XT uint16_t
#define TO_X(v) float_to_bf16(v)
#else
#define DOT_BF16 0
#define XT float
#define TO_X(v) (v)
#endif

/* VL weights widened to fp32. */
static inline vf FN(loadv)(const T *w) {
#if LOAD_IS_BF16
    vu16 raw;
    memcpy(&raw, w, sizeof raw);
    vu32 wide = __builtin_convertvector(raw, vu32) << 16;
    vf out;
    memcpy(&out, &wide, sizeof out);
    return out;
#else
    vf out;
    memcpy(&out, w, sizeof out);
    return out;
#endif
}

#if DOT_BF16
/* out[m * ldo + c] = rows[c] . x[m * ldx] for the first n (<= 4) rows and tokens m < nt, in
 * bf16 pairs accumulated in fp32 (the same tile as below, 32 products per instruction: the
 * 512-bit form made a 4-token verify ~10% faster than 256 bits here). */
static inline __attribute__((always_inline)) void FN(tile)(const T *const rows[4], int n,
                                                          int64_t K, const XT *x,
                                                          int64_t ldx, const int nt, float *out,
                                                          int64_t ldo) {
    const int64_t K32 = K - K % 32;
    __m512 acc[4][4];
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) acc[c][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K32; i += 32) {
        __m512bh xv[4];
        for (int t = 0; t < nt; t++)
            xv[t] = (__m512bh)_mm512_loadu_si512((const void *)(x + t * ldx + i));
        for (int c = 0; c < 4; c++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(rows[c] + i));
            for (int t = 0; t < nt; t++) acc[c][t] = _mm512_dpbf16_ps(acc[c][t], wv, xv[t]);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int c = 0; c < n; c++) {
            float sum = _mm512_reduce_add_ps(acc[c][t]);
            for (int64_t i = K32; i < K; i++)
                sum += bf16_to_float(rows[c][i]) * bf16_to_float(x[t * ldx + i]);
            out[t * ldo + c] = sum;
        }
}
#else
/* out[m * ldo + c] = rows[c] . x[m * ldx] for the first n (<= 4) rows and tokens m < nt
 * (nt <= 4, a constant after inlining). A 4 x nt tile keeps 4 * nt independent accumulator
 * chains in registers and loads each weight vector once for all nt tokens: with one chain a dot
 * product waited on the latency of each fused multiply-add and ran at a quarter of the core's
 * rate. */
static inline __attribute__((always_inline)) void FN(tile)(const T *const rows[4], int n,
                                                          int64_t K, const XT *x,
                                                          int64_t ldx, const int nt, float *out,
                                                          int64_t ldo) {
    const int64_t KV = K - K % VL;
    vf acc[4][4] = {{{0}}};
    for (int64_t i = 0; i < KV; i += VL) {
        vf xv[4];
        for (int t = 0; t < nt; t++) memcpy(&xv[t], x + t * ldx + i, sizeof(vf));
        for (int c = 0; c < 4; c++) {
            const vf wv = FN(loadv)(rows[c] + i);
            for (int t = 0; t < nt; t++) acc[c][t] += wv * xv[t];
        }
    }
    for (int t = 0; t < nt; t++)
        for (int c = 0; c < n; c++) {
            float sum = hsum(acc[c][t]);
            for (int64_t i = KV; i < K; i++) sum += LOAD(rows[c][i]) * x[t * ldx + i];
            out[t * ldo + c] = sum;
        }
}

#endif

/* The tile over every token, four at a time. */
static inline void FN(dots4)(const T *const rows[4], int n, int64_t K, const XT *x,
                             int64_t ldx, int64_t M, float *out, int64_t ldo) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) FN(tile)(rows, n, K, x + m * ldx, ldx, 4, out + m * ldo, ldo);
    switch (M - m) {
    case 3: FN(tile)(rows, n, K, x + m * ldx, ldx, 3, out + m * ldo, ldo); break;
    case 2: FN(tile)(rows, n, K, x + m * ldx, ldx, 2, out + m * ldo, ldo); break;
    case 1: FN(tile)(rows, n, K, x + m * ldx, ldx, 1, out + m * ldo, ldo); break;
    default: break;
    }
}

/* Rows j .. j + 3 of a row-major matrix (the last block repeats its last row). */
static inline int FN(block)(const T *w, int64_t ld, int64_t j, int64_t rows, const T *out[4]) {
    const int n = rows - j < 4 ? (int)(rows - j) : 4;
    for (int c = 0; c < 4; c++) out[c] = w + (j + (c < n ? c : n - 1)) * ld;
    return n;
}

/* x[m * H + j] += w[j] . in[m] for the H rows of w (K wide) and the M tokens: a projection
 * added to the residual stream. The `omp for` shares the rows among the threads of the
 * enclosing parallel region. */
static inline void FN(add_product)(float *x, int64_t H, const T *w, int64_t K, const XT *in,
                                   int64_t M) {
#pragma omp for
    for (int64_t j = 0; j < H; j += 4) {
        const T *rows[4];
        float dots[M * 4];
        const int n = FN(block)(w, K, j, H, rows);
        FN(dots4)(rows, n, K, in, K, M, dots, 4);
        for (int64_t m = 0; m < M; m++)
            for (int c = 0; c < n; c++) x[m * H + j + c] += dots[m * 4 + c];
    }
}

static inline void FN(rms_norm)(const float *x, const T *w, int64_t n, float eps, float *out) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
    const float scale = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * LOAD(w[i]);
}

/* RMSNorm of a row as the input of a matrix product: fp32 into out, and into out_x when the
 * products read bf16. */
static inline void FN(norm_in)(const float *x, const T *w, int64_t n, float eps, float *out,
                               XT *out_x) {
    FN(rms_norm)(x, w, n, eps, out);
    if (DOT_BF16)
        for (int64_t i = 0; i < n; i++) out_x[i] = TO_X(out[i]);
}

static inline __attribute__((always_inline)) int FN(body)(const struct model_args *a,
                                                          const struct batch *b, float *logits,
                                                          int64_t threads, const int64_t head_dim) {
    const int64_t M = b->M, H = a->hidden, I = a->intermediate;
    const int64_t heads = a->heads, kv_heads = a->kv_heads, half = head_dim / 2;
    const int64_t qdim = heads * head_dim, kvdim = kv_heads * head_dim;
    const int64_t qk = qdim + kvdim, width = qk + kvdim; /* q, k, v columns per token */
    const int64_t bs = a->block_size;
    const int shift = log2_block(bs);
    const float eps = (float)a->eps, scale = (float)a->scale;
    float *buf =
        malloc(sizeof(float) * (size_t)(M * (2 * H + width + qdim + I) + b->L * H));
    if (buf == NULL) return 1;
    float *x = buf, *h = x + M * H, *qkv = h + M * H, *att = qkv + M * width;
    float *act = att + M * qdim, *fin = act + M * I;
#if DOT_BF16
    XT *xbuf = malloc(sizeof(XT) * (size_t)(M * (H + qdim + I) + b->L * H));
    if (xbuf == NULL) {
        free(buf);
        return 1;
    }
    XT *hx = xbuf, *attx = hx + M * H, *actx = attx + M * qdim, *finx = actx + M * I;
#else
    XT *hx = h, *attx = att, *actx = act, *finx = fin;
#endif
    const T *embed = a->embed, *head = a->head;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < H; i++) x[m * H + i] = LOAD(embed[b->ids[m] * H + i]);
        for (int64_t l = 0; l < a->num_layers; l++) {
            const struct layer_weights *w = &a->layers[l];
            const T *wqkv = w->qkv, *bias = w->qkv_bias, *wo = w->o;
            const T *wgu = w->gate_up, *wdown = w->down;
            T *pool = (T *)a->pool + l * a->layer_stride;
#pragma omp for
            for (int64_t m = 0; m < M; m++)
                FN(norm_in)(x + m * H, w->attn_norm, H, eps, h + m * H, hx + m * H);
            /* column j < qk comes from weight row j; v columns skip the rotated rows (qk is a
             * multiple of 4, so no block straddles the two) */
#pragma omp for
            for (int64_t j = 0; j < width; j += 4) {
                const T *rows[4];
                const int64_t skip = j < qk ? 0 : qk;
                const int n = FN(block)(wqkv + skip * H, H, j, width, rows);
                FN(dots4)(rows, n, H, hx, H, M, qkv + j, width);
                if (bias)
                    for (int64_t m = 0; m < M; m++)
                        for (int c = 0; c < n; c++) qkv[m * width + j + c] += LOAD(bias[skip + j + c]);
            }
            /* rotary embedding of every q and k head; keys and values into the pool */
#pragma omp for
            for (int64_t t = 0; t < M * (heads + kv_heads); t++) {
                const int64_t m = t / (heads + kv_heads), hh = t % (heads + kv_heads);
                float *v = qkv + m * width + hh * head_dim, rot[head_dim];
                const float *c = a->cos + b->positions[m] * head_dim;
                const float *s = a->sin + b->positions[m] * head_dim;
                for (int64_t i = 0; i < half; i++) {
                    rot[i] = v[i] * c[i] - v[i + half] * s[i];
                    rot[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
                }
                for (int64_t i = 0; i < head_dim; i++) v[i] = rot[i];
                if (hh >= heads) {
                    const int64_t off = (hh - heads) * head_dim;
                    T *key = pool + b->slots[m] * kvdim + off;
                    T *val = pool + (b->slots[m] + bs) * kvdim + off;
                    const float *vsrc = qkv + m * width + qk + off;
                    for (int64_t i = 0; i < head_dim; i++) {
                        key[i] = STORE(v[i]);
                        val[i] = STORE(vsrc[i]);
                    }
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < b->R * kv_heads; item++) {
                const int64_t r = item / kv_heads, kvh = item % kv_heads;
                if (ATTEND(qkv, width, pool, b->tables + r * b->W, b->q_start[r],
                           b->q_len[r], b->num_cached[r], b->masks ? b->mask_from[r] : 0,
                           b->masks ? b->masks + b->q_start[r] : NULL, kvh, heads, kv_heads,
                           head_dim, shift, scale, att)) {
#pragma omp atomic write
                    failed = 1;
                }
            }
#if DOT_BF16
#pragma omp for
            for (int64_t i = 0; i < M * qdim; i++) attx[i] = TO_X(att[i]);
#endif
            FN(add_product)(x, H, wo, qdim, attx, M);
#pragma omp for
            for (int64_t m = 0; m < M; m++)
                FN(norm_in)(x + m * H, w->mlp_norm, H, eps, h + m * H, hx + m * H);
            /* two gate rows and the two matching up rows per block */
#pragma omp for
            for (int64_t i = 0; i < I; i += 2) {
                const int n = I - i < 2 ? 1 : 2;
                const T *rows[4] = {wgu + i * H, wgu + (i + n - 1) * H, wgu + (I + i) * H,
                                    wgu + (I + i + n - 1) * H};
                float gu[M * 4];
                FN(dots4)(rows, 4, H, hx, H, M, gu, 4);
                for (int64_t m = 0; m < M; m++)
                    for (int c = 0; c < n; c++) {
                        const float g = gu[m * 4 + c], u = gu[m * 4 + 2 + c];
                        actx[m * I + i + c] = TO_X(g / (1.0f + expf(-g)) * u);
                    }
            }
            FN(add_product)(x, H, wdown, I, actx, M);
        }
#pragma omp for
        for (int64_t r = 0; r < b->L; r++)
            FN(norm_in)(x + b->logit_rows[r] * H, a->final_norm, H, eps, fin + r * H,
                        finx + r * H);
#pragma omp for
        for (int64_t v = 0; v < a->head_rows; v += 4) {
            const T *rows[4];
            const int n = FN(block)(head, H, v, a->head_rows, rows);
            FN(dots4)(rows, n, H, finx, H, b->L, logits + v, a->head_rows);
        }
    }
#if DOT_BF16
    free(xbuf);
#endif
    free(buf);
    return failed;
}

/* The forward with head_dim a constant in the attention loops. */
static int FN(run)(const struct model_args *a, const struct batch *b, float *logits,
                   int64_t threads) {
    switch (a->head_dim) {
    case 32: return FN(body)(a, b, logits, threads, 32);
    case 64: return FN(body)(a, b, logits, threads, 64);
    case 128: return FN(body)(a, b, logits, threads, 128);
    default: return FN(body)(a, b, logits, threads, a->head_dim);
    }
}

int FN(decode_forward)(const struct model_args *a, const int64_t *batch, float *logits,
                       int64_t threads) {
    const struct batch b = read_batch(batch);
    return FN(run)(a, &b, logits, threads);
}

/* A draft's greedy proposals, up to steps[r] tokens for request r, in one call: returning to
 * Python between draft steps cost more than a small draft's forward. Step 0 runs `batch` (whose
 * logit rows are each request's last row, in request order); every later step feeds each
 * request still short of its count its previous argmax (through `vocab` when the head is cut)
 * at the next position. With `conf`, each token's confidence (its softmax probability over the
 * head) is written there, and with `floors` too, request r stops early once the predicted
 * acceptance of its next token (the product of its tokens' chances so far times the last one,
 * SpecServe's drafter) falls below floors[r]; a token's chance is its confidence, or with
 * `chances` the acceptance chances[b] of its bin b of `bins` equal bins of confidence (a
 * softmax maximum lies in (0, 1]).
 * Block tables must already cover every token the steps write. Writes out[r * max(steps) + s]
 * and (with `conf`) conf[r * max(steps) + s] for the tokens made; returns 1 if a buffer could
 * not be allocated. */
int FN(greedy_chain)(const struct model_args *a, const int64_t *batch, const int64_t *steps,
                     const int64_t *vocab, const float *floors, const float *chances,
                     int64_t bins, int64_t *out, float *conf, int64_t threads) {
    const struct batch first = read_batch(batch);
    const int64_t R = first.R, W = first.W, V = a->head_rows, bs = a->block_size;
    int64_t most = 0;
    for (int64_t r = 0; r < R; r++) most = steps[r] > most ? steps[r] : most;
    float *logits = malloc(sizeof(float) * (size_t)(R * V));
    /* per request: its row in the current step, then ids, positions, slots, logit rows,
     * q_start, q_len, num_cached and tables of the next step's batch */
    int64_t *next = malloc(sizeof(int64_t) * (size_t)(R * (8 + W)));
    float *accept = malloc(sizeof(float) * (size_t)R);
    if (logits == NULL || next == NULL || accept == NULL) {
        free(logits);
        free(next);
        free(accept);
        return 1;
    }
    int64_t *req = next, *ids = req + R, *pos = ids + R, *slots = pos + R, *rows = slots + R;
    int64_t *q_start = rows + R, *q_len = q_start + R, *cached = q_len + R, *tables = cached + R;
    int64_t active = R;
    for (int64_t r = 0; r < R; r++) {
        req[r] = r;
        accept[r] = 1.0f;
    }
    int failed = FN(run)(a, &first, logits, threads);
    for (int64_t s = 0; !failed && active > 0; s++) {
        int64_t kept = 0;
        for (int64_t i = 0; i < active; i++) {
            const int64_t r = req[i];
            const float *row = logits + i * V;
            int64_t best = 0;
            for (int64_t v = 1; v < V; v++) best = row[v] > row[best] ? v : best;
            const int64_t token = vocab ? vocab[best] : best;
            out[r * most + s] = token;
            int stop = 0;
            if (conf) {
                float total = 0.0f;
                for (int64_t v = 0; v < V; v++) total += expf(row[v] - row[best]);
                const float c = 1.0f / total;
                conf[r * most + s] = c;
                float chance = c;
                if (chances) {
                    /* in double, as Python bins the same float confidence */
                    const int64_t bin = c > 0.0f ? (int64_t)((double)c * (double)bins) : 0;
                    chance = chances[bin < bins ? bin : bins - 1];
                }
                accept[r] *= chance;
                stop = floors && accept[r] * chance < floors[r];
            }
            if (s + 1 >= steps[r] || stop) continue;
            /* token s + 1 of request r: cache index (its context after step 0) + s */
            const int64_t last = first.q_start[r] + first.q_len[r] - 1;
            const int64_t at = first.num_cached[r] + first.q_len[r] + s;
            const int64_t *table = first.tables + r * W;
            req[kept] = r;
            ids[kept] = token;
            pos[kept] = first.positions[last] + s + 1;
            slots[kept] = table[at / bs] * 2 * bs + at % bs;
            rows[kept] = q_start[kept] = kept;
            q_len[kept] = 1;
            cached[kept] = at;
            memcpy(tables + kept * W, table, sizeof(int64_t) * (size_t)W);
            kept++;
        }
        active = kept;
        if (active == 0) break;
        const struct batch b = {active, active, W,      active, ids,    pos,  slots,
                                rows,   q_start, q_len, cached, tables, NULL, NULL};
        failed = FN(run)(a, &b, logits, threads);
    }
    free(next);
    free(logits);
    free(accept);
    return failed;
}

/* AdaServe's beam for greedy requests (replica/spec/draft.py, DraftModel.propose_trees),
 * every level in one C call as greedy_chain does for chains: `batch` is the first level (each
 * request's uncached known tokens, its last one the tree's root, one logit row each); request
 * r grows depths[r] levels. Each level keeps the `width` children of highest path score over
 * all parents: a child of rank j (the parent's j-th likeliest token, probability q) scores its
 * parent's score times chances[min(j, ranks - 1) * bins + bin(q)] (the calibration, equal bins
 * of q); its path probability is its parent's times q. The next
 * level feeds the kept children, each seeing the context (keys before its request's known
 * length) and its own ancestors, whose cache positions follow the known tokens level by level.
 * Request r's nodes go to tokens/parents/probs/node_ranks[r * (1 + max depth * width) + i],
 * node 0 its
 * root, and counts[r] says how many; block tables must cover every level's slots; returns 1 if
 * a buffer could not be allocated. */
int FN(greedy_tree)(const struct model_args *a, const int64_t *batch, const int64_t *depths,
                    int64_t width, const int64_t *vocab, const double *chances, int64_t bins,
                    int64_t ranks, int64_t *tokens, int64_t *parents, float *probs,
                    int64_t *node_ranks, int64_t *counts, int64_t threads) {
    const struct batch first = read_batch(batch);
    const int64_t R = first.R, W = first.W, V = a->head_rows, bs = a->block_size;
    int64_t most = 0;
    for (int64_t r = 0; r < R; r++) most = depths[r] > most ? depths[r] : most;
    const int64_t stride = 1 + most * width, rows_max = R * width > R ? R * width : R;
    float *logits = malloc(sizeof(float) * (size_t)(rows_max * V));
    /* scores in double, as Python multiplies its chances: near ties fall the same way */
    double *score = malloc(sizeof(double) * (size_t)(R * stride));
    /* per node: the bits of its ancestors' and its own cache positions from the context on */
    uint64_t *bits = malloc(sizeof(uint64_t) * (size_t)(R * stride));
    /* the current level and the next: (request, node) of each logit row */
    int64_t *level = malloc(sizeof(int64_t) * (size_t)(4 * rows_max));
    /* per request: the next free cache position (after the known tokens and fed levels) */
    int64_t *written = malloc(sizeof(int64_t) * (size_t)R);
    /* the next batch's arrays */
    int64_t *next = malloc(sizeof(int64_t) * (size_t)(rows_max * 6 + R * (4 + W)));
    /* candidates of one request: score, probability, (parent, token, rank) */
    double *cand_score = malloc(sizeof(double) * (size_t)(width * width));
    float *cand_prob = malloc(sizeof(float) * (size_t)(width * width));
    int64_t *cand_node = malloc(sizeof(int64_t) * (size_t)(3 * width * width));
    int failed = !logits || !score || !bits || !level || !written || !next ||
                 !cand_score || !cand_prob || !cand_node;
    int64_t rows = 0;
    for (int64_t r = 0; r < R && !failed; r++) {
        const int64_t root = first.q_start[r] + first.q_len[r] - 1;
        tokens[r * stride] = first.ids[root];
        parents[r * stride] = -1;
        probs[r * stride] = 1.0f;
        node_ranks[r * stride] = 0;
        score[r * stride] = 1.0;
        bits[r * stride] = 0;
        counts[r] = 1;
        written[r] = first.num_cached[r] + first.q_len[r];
        level[2 * rows] = r;
        level[2 * rows + 1] = 0;
        rows++;
    }
    if (!failed) failed = FN(run)(a, &first, logits, threads);
    for (int64_t depth = 1; !failed && depth <= most; depth++) {
        int64_t kept = 0; /* rows of the next level */
        int64_t *next_level = level + 2 * rows_max;
        for (int64_t i = 0; i < rows;) {
            const int64_t r = level[2 * i];
            int64_t end = i;
            while (end < rows && level[2 * end] == r) end++;
            int64_t n = 0;
            if (depths[r] >= depth) {
                for (int64_t row = i; row < end; row++) {
                    const int64_t parent = level[2 * row + 1];
                    const float *l = logits + row * V;
                    int64_t top[4] = {-1, -1, -1, -1};
                    float best = l[0];
                    for (int64_t v = 1; v < V; v++) best = l[v] > best ? l[v] : best;
                    float total = 0.0f;
                    for (int64_t v = 0; v < V; v++) total += expf(l[v] - best);
                    for (int64_t v = 0; v < V; v++) {
                        int64_t at = width;
                        while (at > 0 && (top[at - 1] < 0 || l[v] > l[top[at - 1]])) at--;
                        if (at >= width) continue;
                        for (int64_t k = width - 1; k > at; k--) top[k] = top[k - 1];
                        top[at] = v;
                    }
                    for (int64_t j = 0; j < width && top[j] >= 0; j++) {
                        const float q = expf(l[top[j]] - best) / total;
                        if (!(q > 0.0f)) continue;
                        /* in double, as Python bins the same float probability */
                        const int64_t bin = (int64_t)((double)q * (double)bins);
                        const int64_t rank = j < ranks ? j : ranks - 1;
                        const double chance = chances[rank * bins + (bin < bins ? bin : bins - 1)];
                        const float f = probs[r * stride + parent] * q;
                        cand_score[n] = score[r * stride + parent] * chance;
                        cand_prob[n] = f < 1.0f ? f : 1.0f;
                        cand_node[3 * n] = parent;
                        cand_node[3 * n + 1] = vocab ? vocab[top[j]] : top[j];
                        cand_node[3 * n + 2] = j;
                        n++;
                    }
                }
            }
            /* keep the `width` best, ties to the earlier candidate (a stable sort's order) */
            for (int64_t pick = 0; pick < width && n > 0; pick++) {
                int64_t b = -1;
                for (int64_t c = 0; c < n; c++)
                    if (cand_node[3 * c] >= 0 && (b < 0 || cand_score[c] > cand_score[b])) b = c;
                if (b < 0) break;
                const int64_t node = counts[r]++;
                const int64_t parent = cand_node[3 * b];
                tokens[r * stride + node] = cand_node[3 * b + 1];
                parents[r * stride + node] = parent;
                probs[r * stride + node] = cand_prob[b];
                node_ranks[r * stride + node] = cand_node[3 * b + 2];
                score[r * stride + node] = cand_score[b];
                cand_node[3 * b] = -1;
                if (depths[r] > depth) {
                    next_level[2 * kept] = r;
                    next_level[2 * kept + 1] = node;
                    kept++;
                }
            }
            i = end;
        }
        if (kept == 0) break;
        /* the next batch: one row per kept node, its request's cache positions in order */
        int64_t *ids = next, *pos = ids + kept, *slots = pos + kept, *lrows = slots + kept;
        int64_t *q_start = lrows + kept, *q_len = q_start + R, *cached = q_len + R;
        int64_t *tables = cached + R, *mask_from = tables + R * W;
        uint64_t *masks = (uint64_t *)(mask_from + R);
        int64_t reqs = 0;
        for (int64_t k = 0; k < kept; k++) {
            const int64_t r = next_level[2 * k], node = next_level[2 * k + 1];
            const int64_t context = first.num_cached[r] + first.q_len[r];
            const int64_t *table = first.tables + r * W;
            if (k == 0 || next_level[2 * (k - 1)] != r) {
                q_start[reqs] = k;
                q_len[reqs] = 0;
                cached[reqs] = written[r];
                mask_from[reqs] = context;
                memcpy(tables + reqs * W, table, sizeof(int64_t) * (size_t)W);
                reqs++;
            }
            const int64_t at = cached[reqs - 1] + q_len[reqs - 1];
            const int64_t parent = parents[r * stride + node];
            bits[r * stride + node] = bits[r * stride + parent] | ((uint64_t)1 << (at - context));
            ids[k] = tokens[r * stride + node];
            pos[k] = first.positions[first.q_start[r] + first.q_len[r] - 1] + depth;
            slots[k] = table[at / bs] * 2 * bs + at % bs;
            lrows[k] = k;
            masks[k] = bits[r * stride + node];
            q_len[reqs - 1]++;
            written[r]++;
        }
        for (int64_t k = 0; k < kept; k++) {
            level[2 * k] = next_level[2 * k];
            level[2 * k + 1] = next_level[2 * k + 1];
        }
        rows = kept;
        const struct batch b = {kept,   reqs,  W,      kept,   ids,       pos,  slots,
                                lrows,  q_start, q_len, cached, tables, mask_from, masks};
        failed = FN(run)(a, &b, logits, threads);
    }
    free(logits);
    free(score);
    free(bits);
    free(level);
    free(written);
    free(next);
    free(cand_score);
    free(cand_prob);
    free(cand_node);
    return failed;
}

#undef DOT_BF16
#undef XT
#undef TO_X
#undef T
#undef LOAD_IS_BF16
#undef LOAD
#undef STORE
#undef SUFFIX
#undef ATTEND
