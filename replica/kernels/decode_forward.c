/* The whole forward pass of a Llama/Qwen2 stack for batches of few tokens, in one C call.
 *
 * At batch 1 a forward through PyTorch is ~20 op calls per layer, each paying dispatch and
 * (with two thread pools) wake-up costs that dwarf its arithmetic: a 2-layer draft spent more
 * time in per-op work than in its weights. This file runs every layer of a decode or verify
 * batch inside one OpenMP parallel region: embedding, RMSNorm, fused QKV with rotary
 * embedding, KV write into the paged pool, paged attention (attend_one.h), output projection,
 * SwiGLU MLP, final norm and LM head, with barriers between phases and scratch buffers
 * allocated once per call.
 *
 * Every matrix product is one pass over the weight rows, four rows at a time used for all
 * tokens while they are in L1: for a few tokens the step is bound by reading the weights once,
 * which is also why the batch-1 cost follows a model's weight bytes.
 *
 * Layout contracts (shared with replica/model_runner.py):
 * - qkv rows: q (heads x head_dim), k (kv_heads x head_dim), rotate_half(q), rotate_half(k),
 *   v; this file skips the rotated rows and rotates q and k itself;
 * - gate_up rows: gate (intermediate), then up (intermediate);
 * - pool per layer: rows of [kv_heads, head_dim]; a token's key in row slots[t], its value
 *   block_size rows later; block tables, like every index, are int64;
 * - cos/sin: fp32 [max positions, head_dim], halves repeated as transformers builds them.
 * Activations stay fp32 for both weight types.
 */
#include "paged_attention.c"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

struct layer_weights {
    const void *attn_norm, *qkv, *qkv_bias, *o, *mlp_norm, *gate_up, *down;
};

/* What never changes between calls: weights, tables, shapes. Every field is 8 bytes, so the
 * ctypes mirror in replica/cpu_kernels.py has no padding. */
struct model_args {
    const void *embed;
    const struct layer_weights *layers;
    int64_t num_layers;
    const void *final_norm, *head;
    int64_t head_rows;
    const float *cos, *sin;
    void *pool;
    int64_t layer_stride, hidden, intermediate, heads, kv_heads, head_dim, block_size;
    double eps, scale;
};

/* One batch, as one int64 array (one tensor to build per call from Python):
 *   M tokens, R requests, W block-table width, L logit rows, T 1 if it has tree masks, then
 *   ids[M], positions[M], slots[M], logit_rows[L],
 *   q_start[R], q_len[R], num_cached[R], tables[R * W], and with T: mask_from[R], masks[M]
 *   (attend_one.h: each new token's visible keys from mask_from on, as bits). */
struct batch {
    int64_t M, R, W, L;
    const int64_t *ids, *positions, *slots, *logit_rows, *q_start, *q_len, *num_cached, *tables;
    const int64_t *mask_from;
    const uint64_t *masks; /* NULL: causal */
};

static inline struct batch read_batch(const int64_t *b) {
    struct batch out = {b[0], b[1], b[2], b[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t trees = b[4];
    const int64_t *p = b + 5;
    out.ids = p;
    out.positions = p += out.M;
    out.slots = p += out.M;
    out.logit_rows = p += out.M;
    out.q_start = p += out.L;
    out.q_len = p += out.R;
    out.num_cached = p += out.R;
    out.tables = p += out.R;
    if (trees) {
        out.mask_from = p += out.R * out.W;
        out.masks = (const uint64_t *)(p + out.R);
    }
    return out;
}

/* bf16 weights: queries and outputs are fp32 scratch rows, the pool bf16. (fp32 uses
 * paged_attention.c's attend_one_f32 as it is.) */
#define ATTEND_NAME attend_fused_bf16
#define TQ float
#define LOADQ IDENTITY
#define TKV uint16_t
#define LOADKV bf16_to_float
#define TO float
#define STORE IDENTITY
#include "attend_one.h"

/* The forward once per weight type: decode_forward_body.h is written against T, LOAD_IS_BF16,
 * LOAD, STORE, SUFFIX and ATTEND, and undefines them at its end. */
#define PASTE(a, b) a##_##b
#define NAMED(a, b) PASTE(a, b)
#define FN(name) NAMED(name, SUFFIX)

/* 8 floats, one AVX register: 16-float vectors measured slower here for several tokens. */
typedef float vf __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint16_t vu16 __attribute__((vector_size(16)));
typedef uint32_t vu32 __attribute__((vector_size(32)));
#define VL 8

static inline float hsum(vf v) {
    vf4 h4 = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

#define T float
#define LOAD_IS_BF16 0
#define LOAD(x) (x)
#define STORE(x) (x)
#define SUFFIX f32
#define ATTEND attend_one_f32
#include "decode_forward_body.h"

#define T uint16_t
#define LOAD_IS_BF16 1
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define SUFFIX bf16
#define ATTEND attend_fused_bf16
#include "decode_forward_body.h"
