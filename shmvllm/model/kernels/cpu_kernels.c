/* CPU kernels for the decoder's small ops, one call each where torch needs several, built
 * twice from this source: for fp32 activations, and with -DSHM_BF16 for bf16 ones.
 *
 * bf16 build: activations, weights, biases and KV caches are bf16 (act_t = uint16_t, the top
 * half of an IEEE float), loaded into fp32 (LD), computed and accumulated in fp32 and rounded
 * back to nearest-even (ST) once per stored value; RoPE tables, scales and eps stay fp32.
 * Where transformers' bf16 modules round an intermediate (the normalized row before the norm
 * weight, silu(gate) before the product, cos/sin cast to bf16), the kernel rounds it too (RB),
 * so that its values stay within one rounding of the reference's. The conversions are plain
 * integer shifts, which gcc vectorizes for whatever -march=native gives (AVX-512 here).
 *
 * Why: at the batch sizes of decoding, torch spends more time dispatching and entering OpenMP
 * regions for rms_norm (pow, mean, add, rsqrt, mul, mul), rotary and silu-and-mul than
 * computing them; these do it in one pass over the data, on one thread when the work is small.
 *
 * Decode attention: in torch, decode attention has to gather every request's context blocks into
 * a padded tensor first (index_select), which copies the whole KV context once per layer and
 * step and costs more than the attention that then reads it. Here each (request, kv head) task
 * reads its keys and values straight from their blocks, once.
 *
 * Layout (see attention.py): k_cache / v_cache are [kv_heads, num_blocks * block_size, head_dim];
 * q / k / v are rows of the step's flat batch, [num_heads | kv_heads, head_dim] each, a row
 * `*_row_stride` floats after the previous one (views into the fused qkv projection).
 *
 * Parallelism: OpenMP. Built against libgomp.so.1, the soname torch itself loads, so the
 * dynamic loader binds this library to torch's OpenMP runtime: one thread pool, and
 * torch.set_num_threads applies here too.
 */
#if defined(SHM_BF16) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef SHM_BF16
typedef uint16_t act_t;
static inline float LD(act_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline act_t ST(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (act_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#define RB(f) LD(ST(f))
#else
typedef float act_t;
#define LD(v) (v)
#define ST(v) (v)
#define RB(v) (v)
#endif

#include "attention.h"

/* Threads pay off above about this many floats of work. */
#define PARALLEL_MIN_FLOATS (1 << 17)
/* A gated activation's element costs about this many floats' work (an expf / tanhf each): a
 * prefill's 85 x 1536 SiLU-and-mul (~0.1 ms on one thread) then runs on every thread. */
#define TRANSCENDENTAL_FLOATS 8

/* Runs `call` for each row t_ in [0, rows): across the threads where `big`, else inline. A region
 * entered with if (false) still has libgomp set up a team of one (~1 us a call), which the decode
 * step's threads paid at each of their norms, rotaries and KV writes. */
#define EACH_ROW(rows, big, ...)                                   \
    do {                                                           \
        if (big) {                                                 \
            _Pragma("omp parallel for")                            \
            for (int64_t t_ = 0; t_ < (rows); t_++) __VA_ARGS__;   \
        } else {                                                   \
            for (int64_t t_ = 0; t_ < (rows); t_++) __VA_ARGS__;   \
        }                                                          \
    } while (0)

static inline void write_kv_row(const act_t *k, const act_t *v, int64_t slot, act_t *k_cache, act_t *v_cache,
                                int64_t head_stride, int64_t kv_heads, int64_t head_dim) {
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t dst = h * head_stride + slot * head_dim;
        memcpy(k_cache + dst, k + h * head_dim, (size_t)head_dim * sizeof(act_t));
        memcpy(v_cache + dst, v + h * head_dim, (size_t)head_dim * sizeof(act_t));
    }
}

/* Writes the step's new keys and values into their cache slots. */
void shm_write_kv_cache(const act_t *k, int64_t k_row_stride, const act_t *v, int64_t v_row_stride,
                        const int64_t *slot_mapping, int64_t num_tokens, act_t *k_cache, act_t *v_cache,
                        int64_t num_slots, int64_t kv_heads, int64_t head_dim) {
    EACH_ROW(num_tokens, 2 * num_tokens * kv_heads * head_dim >= PARALLEL_MIN_FLOATS,
             write_kv_row(k + t_ * k_row_stride, v + t_ * v_row_stride, slot_mapping[t_], k_cache, v_cache,
                          num_slots * head_dim, kv_heads, head_dim));
}

/* Hints a block's rows into L2 ahead of their use: blocks are scattered pages, which the hardware
 * prefetcher does not follow. Into L2, not L1: a block is 64 lines and L1 holds few misses in
 * flight (C harness, 150 positions from memory, one thread: 28.2 -> 21.9 us a layer with the
 * fast heads' next block of keys and values into L2 instead of the next keys and this block's
 * values into L1; 4,096 positions 630 -> 480 us; from cache unchanged). */
static inline void prefetch_block(const act_t *rows, int64_t count, int64_t head_dim) {
    for (int64_t off = 0; off < count * head_dim; off += 64 / sizeof(act_t)) __builtin_prefetch(rows + off, 0, 2);
}

/* The first row of a request's b-th block in one head's [slots, head_dim] cache. */
static inline const act_t *block_rows(const act_t *head, const int32_t *blocks, int64_t b, int64_t block_size,
                                      int64_t head_dim) {
    return head + (int64_t)blocks[b] * block_size * head_dim;
}

/* Decode attention is cut into tasks of (request, kv head, run of ATTN_CHUNK positions), so that
 * a long context spreads over every thread, not one thread per kv head (SmolLM2 has 3 kv heads
 * for 2 threads); a short context's few such tasks are cut by query head (attention.h); a request whose context fits one run is one task that writes its output
 * directly, with the arithmetic of a plain softmax-then-weighted-sum. Longer ones leave each
 * run's (max, sum, unnormalized weighted sum) and a combine step scales and adds them. The same
 * tasks serve the layer path (shm_paged_decode_attention) and the native decode step
 * (decode_step.c), so both give the same values bit for bit, at any thread count. */

/* Scores of positions [start, end) for `group` query heads into s[g * (end - start) + pos]. */
static void attention_scores(const act_t *q, const act_t *k_head, const int32_t *blocks, int64_t start, int64_t end,
                             int64_t block_size, int64_t group, int64_t head_dim, float scale, float softcap, float *s) {
    const int64_t len = end - start;
    for (int64_t b = start / block_size; b * block_size < end; b++) {
        const act_t *keys = block_rows(k_head, blocks, b, block_size, head_dim);
        if ((b + 1) * block_size < end) prefetch_block(block_rows(k_head, blocks, b + 1, block_size, head_dim), block_size, head_dim);
        const int64_t j0 = b * block_size < start ? start - b * block_size : 0;
        for (int64_t j = j0; j < block_size && b * block_size + j < end; j++) {
            const act_t *key = keys + j * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const act_t *qg = q + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += LD(qg[d]) * LD(key[d]);
                /* soft-capping in transformers' order: score * scale / cap, tanh, times cap */
                s[g * len + b * block_size + j - start] = softcap > 0.0f ? tanhf(dot * scale / softcap) * softcap : dot * scale;
            }
        }
    }
}

/* acc[g] = sum over positions [start, end) of p[g * (end - start) + pos] * value[pos]. */
static void attention_values(const act_t *v_head, const int32_t *blocks, int64_t start, int64_t end, int64_t block_size,
                             int64_t group, int64_t head_dim, const float *p, float *acc) {
    const int64_t len = end - start;
    memset(acc, 0, (size_t)(group * head_dim) * sizeof(float));
    prefetch_block(block_rows(v_head, blocks, start / block_size, block_size, head_dim), block_size, head_dim);
    for (int64_t b = start / block_size; b * block_size < end; b++) {
        const act_t *values = block_rows(v_head, blocks, b, block_size, head_dim);
        if ((b + 1) * block_size < end) prefetch_block(block_rows(v_head, blocks, b + 1, block_size, head_dim), block_size, head_dim);
        const int64_t j0 = b * block_size < start ? start - b * block_size : 0;
        for (int64_t j = j0; j < block_size && b * block_size + j < end; j++) {
            const act_t *value = values + j * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float pj = p[g * len + b * block_size + j - start];
                float *a = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += pj * LD(value[d]);
            }
        }
    }
}

#ifndef SHM_BF16
/* fp32 heads of 64 or 128 features: scores and values with a head's accumulators in registers
 * (the loops above keep them in memory, so each position waits on the previous one's stores),
 * compiled for each of the two widths. Same products, their sums in another order. */
#ifdef __AVX512F__
#define HV 16 /* floats a head_vec: one zmm */
#else
#define HV 8 /* one ymm: as two-ymm vectors the AVX2 build ran 4x slower (598 against 149 us a layer at 4,096 positions) */
#endif
typedef float head_vec __attribute__((vector_size(HV * 4)));
#define HEAD_VECS_MAX (128 / HV)
static inline int fast_head(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
static inline head_vec load_head_vec(const float *p) {
    head_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline float head_vec_sum(head_vec v) {
    typedef float h8 __attribute__((vector_size(32)));
    typedef float h4 __attribute__((vector_size(16)));
#if HV == 16
    const h8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const h8 a = v;
#endif
    const h4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* The scores pass also hints the value rows, which the values pass reads next: the two streams'
 * misses overlap instead of the values pass waiting on memory block by block. Each block's keys
 * and values are hinted one block ahead (the first block's as the pass starts). */
static inline __attribute__((always_inline)) void scores_fixed(const int64_t nv, const float *q, const float *k_head,
                                                               const float *v_head, const int32_t *blocks, int64_t start,
                                                               int64_t end, int64_t block_size, int64_t group, float scale,
                                                               float softcap, float *s) {
    const int64_t len = end - start, head_dim = HV * nv;
    for (int64_t b = start / block_size; b * block_size < end; b++) {
        const float *keys = block_rows(k_head, blocks, b, block_size, head_dim);
        for (int64_t ahead = b == start / block_size ? b : b + 1; ahead <= b + 1 && ahead * block_size < end; ahead++) {
            prefetch_block(block_rows(k_head, blocks, ahead, block_size, head_dim), block_size, head_dim);
            prefetch_block(block_rows(v_head, blocks, ahead, block_size, head_dim), block_size, head_dim);
        }
        const int64_t j0 = b * block_size < start ? start - b * block_size : 0;
        for (int64_t j = j0; j < block_size && b * block_size + j < end; j++) {
            const float *key = keys + j * head_dim;
            head_vec kv[HEAD_VECS_MAX];
            for (int64_t c = 0; c < nv; c++) kv[c] = load_head_vec(key + HV * c);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * head_dim;
                head_vec a0 = load_head_vec(qg) * kv[0], a1 = {0};
                for (int64_t c = 1; c < nv; c++) {
                    if (c & 1) a1 += load_head_vec(qg + HV * c) * kv[c];
                    else a0 += load_head_vec(qg + HV * c) * kv[c];
                }
                const float dot = head_vec_sum(a0 + a1);
                s[g * len + b * block_size + j - start] = softcap > 0.0f ? tanhf(dot * scale / softcap) * softcap : dot * scale;
            }
        }
    }
}

static inline __attribute__((always_inline)) void values_fixed(const int64_t nv, const float *v_head,
                                                               const int32_t *blocks, int64_t start, int64_t end,
                                                               int64_t block_size, int64_t group, const float *p,
                                                               float *acc) {
    const int64_t len = end - start, head_dim = HV * nv;
    for (int64_t g = 0; g < group; g++) {
        head_vec a[HEAD_VECS_MAX] = {{0}};
        const float *pg = p + g * len;
        for (int64_t b = start / block_size; b * block_size < end; b++) {
            const float *values = block_rows(v_head, blocks, b, block_size, head_dim);
            const int64_t j0 = b * block_size < start ? start - b * block_size : 0;
            for (int64_t j = j0; j < block_size && b * block_size + j < end; j++) {
                const float *value = values + j * head_dim;
                const head_vec pj = pg[b * block_size + j - start] - (head_vec){0};
                for (int64_t c = 0; c < nv; c++) a[c] += pj * load_head_vec(value + HV * c);
            }
        }
        memcpy(acc + g * head_dim, a, (size_t)head_dim * sizeof(float));
    }
}

static void attention_scores_fast(const float *q, const float *k_head, const float *v_head, const int32_t *blocks,
                                  int64_t start, int64_t end, int64_t block_size, int64_t group, int64_t head_dim,
                                  float scale, float softcap, float *s) {
    if (head_dim == 64) scores_fixed(64 / HV, q, k_head, v_head, blocks, start, end, block_size, group, scale, softcap, s);
    else scores_fixed(128 / HV, q, k_head, v_head, blocks, start, end, block_size, group, scale, softcap, s);
}

static void attention_values_fast(const float *v_head, const int32_t *blocks, int64_t start, int64_t end,
                                  int64_t block_size, int64_t group, int64_t head_dim, const float *p, float *acc) {
    if (head_dim == 64) values_fixed(64 / HV, v_head, blocks, start, end, block_size, group, p, acc);
    else values_fixed(128 / HV, v_head, blocks, start, end, block_size, group, p, acc);
}
#endif

/* exp(s - max) in place over each group's `len` scores; maxes[g], sums[g] receive max and sum. */
static void attention_exp(float *s, int64_t group, int64_t len, float *maxes, float *sums) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = s + g * len;
        float max = sg[0], sum = 0.0f;
        for (int64_t pos = 1; pos < len; pos++) max = sg[pos] > max ? sg[pos] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t pos = 0; pos < len; pos++) {
            sg[pos] = expf(sg[pos] - max);
            sum += sg[pos];
        }
        maxes[g] = max;
        sums[g] = sum;
    }
}

static inline void weigh_values(const act_t *v_head, const int32_t *blocks, int64_t start, int64_t end, int64_t block_size,
                                int64_t group, int64_t head_dim, const float *p, float *acc) {
#ifndef SHM_BF16
    if (fast_head(head_dim)) {
        attention_values_fast(v_head, blocks, start, end, block_size, group, head_dim, p, acc);
        return;
    }
#endif
    attention_values(v_head, blocks, start, end, block_size, group, head_dim, p, acc);
}

/* One task (see above); `work`: attention_work_floats floats of this thread's own;
 * `partials`: shared by the step's tasks. A task past its request's last run does nothing. */
void shm_attention_task(const shm_attention_args *a, int64_t task, float *work, float *partials) {
    const int64_t chunk = task % a->max_chunks, h = (task / a->max_chunks) % a->kv_heads;
    const int64_t slice = (task / (a->max_chunks * a->kv_heads)) % a->head_splits;
    const int64_t i = task / (a->max_chunks * a->kv_heads * a->head_splits);
    const int64_t seq_len = a->seq_lens[i], first = attention_first(seq_len, a->window);
    const int64_t chunks = attention_chunks(seq_len - first);
    if (chunk >= chunks) return;
    const int64_t group = a->num_heads / a->kv_heads, D = a->head_dim, row = a->decode_rows[i];
    /* this task's query heads: [g0, g0 + heads) of kv head h's group */
    const int64_t g0 = slice * group / a->head_splits, heads = (slice + 1) * group / a->head_splits - g0;
    const int64_t start = first + chunk * ATTN_CHUNK, end = start + ATTN_CHUNK < seq_len ? start + ATTN_CHUNK : seq_len;
    const int64_t len = end - start;
    const act_t *q = a->q + row * a->q_row_stride + (h * group + g0) * D;
    const act_t *k_head = a->k_cache + h * a->num_slots * D, *v_head = a->v_cache + h * a->num_slots * D;
    const int32_t *blocks = a->block_table + i * a->block_table_stride;
    float *s = work, *acc = work + heads * len, maxes[heads], sums[heads];
#ifndef SHM_BF16
    if (fast_head(D))
        attention_scores_fast(q, k_head, v_head, blocks, start, end, a->block_size, heads, D, a->scale, a->softcap, s);
    else
#endif
        attention_scores(q, k_head, blocks, start, end, a->block_size, heads, D, a->scale, a->softcap, s);
    attention_exp(s, heads, len, maxes, sums);
    if (chunks == 1) {
        /* the whole context: normalize the probabilities, then weigh the values with them */
        for (int64_t g = 0; g < heads; g++) {
            float total = sums[g], scale = 1.0f;
            if (a->sinks != NULL) { /* exp(sink - max), the max taken over the sink too */
                const float sink = a->sinks[h * group + g0 + g];
                if (sink > maxes[g]) {
                    scale = expf(maxes[g] - sink);
                    total = total * scale + 1.0f;
                } else {
                    total += expf(sink - maxes[g]);
                }
            }
            const float inv = scale / total;
#pragma omp simd
            for (int64_t pos = 0; pos < len; pos++) s[g * len + pos] *= inv;
        }
        weigh_values(v_head, blocks, start, end, a->block_size, heads, D, s, acc);
        act_t *out = a->out + row * a->out_row_stride + (h * group + g0) * D;
        for (int64_t e = 0; e < heads * D; e++) out[e] = ST(acc[e]);
        return;
    }
    /* the run's record: the group's maxes, sums and weighted sums, of which this slice fills its heads' */
    float *part = partials + ((i * a->kv_heads + h) * a->max_chunks + chunk) * group * (D + 2);
    weigh_values(v_head, blocks, start, end, a->block_size, heads, D, s, part + 2 * group + g0 * D);
    for (int64_t g = 0; g < heads; g++) {
        part[g0 + g] = maxes[g];
        part[group + g0 + g] = sums[g];
    }
}

/* Joins the runs of (request, kv head) `pair` = i * kv_heads + h, where its context spans more
 * than one: out = sum_c exp(max_c - max) acc_c / sum_c exp(max_c - max) sum_c. */
void shm_attention_combine(const shm_attention_args *a, int64_t pair, const float *partials) {
    const int64_t i = pair / a->kv_heads, h = pair % a->kv_heads;
    const int64_t chunks = attention_chunks(a->seq_lens[i] - attention_first(a->seq_lens[i], a->window));
    if (chunks == 1) return;
    const int64_t group = a->num_heads / a->kv_heads, D = a->head_dim;
    const float *first = partials + pair * a->max_chunks * group * (D + 2);
    act_t *out = a->out + a->decode_rows[i] * a->out_row_stride + h * group * D;
    for (int64_t g = 0; g < group; g++) {
        float max = first[g];
        for (int64_t c = 1; c < chunks; c++) {
            const float m = first[c * group * (D + 2) + g];
            max = m > max ? m : max;
        }
        const float sink = a->sinks != NULL ? a->sinks[h * group + g] : 0.0f;
        if (a->sinks != NULL && sink > max) max = sink;
        float total = a->sinks != NULL ? expf(sink - max) : 0.0f, acc[D];
        memset(acc, 0, sizeof acc);
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = first + c * group * (D + 2);
            const float w = expf(part[g] - max);
            total += w * part[group + g];
            const float *pa = part + 2 * group + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[d] += w * pa[d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++) out[g * D + d] = ST(acc[d] * inv);
    }
}

/* Decode attention for `num_decodes` requests, each one query token at row decode_rows[i] of
 * q (in) and out (out, rows of [num_heads * head_dim], `out_row_stride` apart), over its first
 * seq_lens[i] cache positions (the last `window` of them when window > 0), found through
 * block_table row i; scores soft-capped at `softcap` when it is > 0; `sinks` (num_heads fp32 or
 * NULL): each head's sink logit in its softmax's denominator. Returns 0, or -1 when the
 * scratch memory could not be allocated (nothing is written then). */
int shm_paged_decode_attention_ex(act_t *out, int64_t out_row_stride, const act_t *q, int64_t q_row_stride,
                                  const int64_t *decode_rows, int64_t num_decodes, const act_t *k_cache,
                                  const act_t *v_cache, int64_t num_slots, const int32_t *block_table,
                                  int64_t block_table_stride, const int32_t *seq_lens, int64_t block_size,
                                  int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                                  float softcap, const float *sinks) {
    const int64_t group = num_heads / kv_heads;
    int64_t max_len = 1, total_len = 0;
    for (int64_t i = 0; i < num_decodes; i++) {
        const int64_t len = seq_lens[i] - attention_first(seq_lens[i], window);
        max_len = len > max_len ? len : max_len;
        total_len += len;
    }
    const int threads = omp_get_max_threads(), parallel = 2 * total_len * kv_heads * head_dim >= PARALLEL_MIN_FLOATS;
    const int64_t chunks = attention_chunks(max_len);
    const shm_attention_args a = {out, out_row_stride, q, q_row_stride, decode_rows, num_decodes, k_cache, v_cache,
                                  num_slots, block_table, block_table_stride, seq_lens, block_size, num_heads,
                                  kv_heads, head_dim, scale, chunks,
                                  parallel ? attention_head_splits(num_decodes * kv_heads * chunks, group, threads) : 1,
                                  window, softcap, sinks};
    const int64_t work_floats = attention_work_floats(group, head_dim);
    const int64_t partial_floats =
        a.max_chunks > 1 ? attention_partial_floats(num_decodes, kv_heads, a.max_chunks, group, head_dim) : 0;
    float *work = malloc((size_t)(threads * work_floats + partial_floats) * sizeof(float));
    if (work == NULL) return -1;
    float *partials = work + threads * work_floats;
    const int64_t tasks = attention_tasks(&a);
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) shm_attention_task(&a, t, work + omp_get_thread_num() * work_floats, partials);
        if (a.max_chunks > 1) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < num_decodes * kv_heads; pair++) shm_attention_combine(&a, pair, partials);
        }
    }
    free(work);
    return 0;
}

/* The whole context, no soft-capping (the Llama options). */
int shm_paged_decode_attention(act_t *out, int64_t out_row_stride, const act_t *q, int64_t q_row_stride,
                               const int64_t *decode_rows, int64_t num_decodes, const act_t *k_cache,
                               const act_t *v_cache, int64_t num_slots, const int32_t *block_table,
                               int64_t block_table_stride, const int32_t *seq_lens, int64_t block_size,
                               int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale) {
    return shm_paged_decode_attention_ex(out, out_row_stride, q, q_row_stride, decode_rows, num_decodes, k_cache,
                                         v_cache, num_slots, block_table, block_table_stride, seq_lens, block_size,
                                         num_heads, kv_heads, head_dim, scale, 0, 0.0f, NULL);
}


/* out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)): transformers' RMSNorm (normalized in
 * fp32, rounded to the activation type, then scaled). */
static inline void rms_norm_row(act_t *dst, const act_t *row, const act_t *weight, int64_t hidden, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; i++) squares += LD(row[i]) * LD(row[i]);
    const float scale = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) dst[i] = ST(LD(weight[i]) * RB(LD(row[i]) * scale));
}

void shm_rms_norm(act_t *out, const act_t *x, const act_t *weight, int64_t rows, int64_t hidden, float eps) {
    EACH_ROW(rows, rows * hidden >= PARALLEL_MIN_FLOATS, rms_norm_row(out + t_ * hidden, x + t_ * hidden, weight, hidden, eps));
}

/* out[t] = silu(gate) * up, where x[t] = [gate | up], each `width` wide. */
static inline void silu_and_mul_row(act_t *dst, const act_t *gate, int64_t width) {
    const act_t *up = gate + width;
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        const float g = LD(gate[i]);
        dst[i] = ST(RB(g / (1.0f + expf(-g))) * LD(up[i]));
    }
}

void shm_silu_and_mul(act_t *out, const act_t *x, int64_t rows, int64_t width) {
    EACH_ROW(rows, rows * width * TRANSCENDENTAL_FLOATS >= PARALLEL_MIN_FLOATS, silu_and_mul_row(out + t_ * width, x + t_ * 2 * width, width));
}

/* out[t] = gelu_tanh(gate) * up, where x[t] = [gate | up], each `width` wide: GeGLU with
 * torch's tanh approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (Gemma). */
static inline void gelu_tanh_and_mul_row(act_t *dst, const act_t *gate, int64_t width) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    const act_t *up = gate + width;
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        const float g = LD(gate[i]);
        dst[i] = ST(RB(0.5f * g * (1.0f + tanhf(beta * (g + kappa * g * g * g)))) * LD(up[i]));
    }
}

void shm_gelu_tanh_and_mul(act_t *out, const act_t *x, int64_t rows, int64_t width) {
    EACH_ROW(rows, rows * width * TRANSCENDENTAL_FLOATS >= PARALLEL_MIN_FLOATS, gelu_tanh_and_mul_row(out + t_ * width, x + t_ * 2 * width, width));
}

/* Neox rotary embedding in place on `heads` heads of each row of x (rows `row_stride` apart):
 * x * cos + swap_halves(x) * sin, with the tables of RotaryEmbedding ([max_position, head_dim],
 * sin with its first half negated) looked up at positions[t]. */
static inline void rotary_row(act_t *x, int64_t heads, int64_t head_dim, const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        act_t *lo = x + h * head_dim, *hi = lo + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = LD(lo[i]), x2 = LD(hi[i]);
            lo[i] = ST(x1 * RB(c[i]) + x2 * RB(s[i]));
            hi[i] = ST(x2 * RB(c[half + i]) + x1 * RB(s[half + i]));
        }
    }
}

void shm_rotary(act_t *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                const int64_t *positions, const float *cos_table, const float *sin_table) {
    EACH_ROW(rows, rows * heads * head_dim >= PARALLEL_MIN_FLOATS,
             rotary_row(x + t_ * row_stride, heads, head_dim, cos_table + positions[t_] * head_dim,
                        sin_table + positions[t_] * head_dim));
}

/* out = x @ w^T (+ bias) (+ residual) for a few rows of x ([rows, k]; w: [n, k] as nn.Linear
 * keeps it): a weight-streaming GEMV. With one to four rows a step is bound by reading the
 * weights, and oneDNN's blocked GEMM reads them at about 60% of the rate this loop does (one
 * pass over each weight row, up to four dot products per pass, threads splitting n). */
#if defined(SHM_BF16) && defined(__AVX512BF16__)
/* With AVX512-BF16 each vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 fp32
 * lanes: the GEMV runs on bf16 dot products, up to four rows per pass over a weight row. */
static inline __m512 dot_step(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

static void linear_few_rows_dp(act_t *out, const act_t *x, const act_t *w, const act_t *bias, const act_t *residual,
                               int64_t rows, int64_t n, int64_t k) {
    const int64_t tail = k % 32, body = k - tail;
    const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1);
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN_FLOATS)
    for (int64_t j = 0; j < n; j++) {
        const act_t *wj = w + j * k;
        const float add = bias != NULL ? LD(bias[j]) : 0.0f;
        for (int64_t m = 0; m < rows; m += 4) {
            const int64_t count = rows - m < 4 ? rows - m : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t i = 0; i < body; i += 32) {
                const __m512i wv = _mm512_loadu_si512((const void *)(wj + i));
                for (int64_t r = 0; r < count; r++)
                    acc[r] = dot_step(acc[r], _mm512_loadu_si512((const void *)(x + (m + r) * k + i)), wv);
            }
            if (tail) {
                const __m512i wv = _mm512_maskz_loadu_epi16(tail_mask, wj + body);
                for (int64_t r = 0; r < count; r++)
                    acc[r] = dot_step(acc[r], _mm512_maskz_loadu_epi16(tail_mask, x + (m + r) * k + body), wv);
            }
            for (int64_t r = 0; r < count; r++) {
                const int64_t at = (m + r) * n + j;
                out[at] = ST(_mm512_reduce_add_ps(acc[r]) + add + (residual != NULL ? LD(residual[at]) : 0.0f));
            }
        }
    }
}
#endif

/* Output columns [j0, j1) of shm_linear_few_rows, on the calling thread (the decode step's
 * team splits the columns itself). */
void shm_linear_rows(act_t *out, const act_t *x, const act_t *w, const act_t *bias, const act_t *residual,
                     int64_t rows, int64_t n, int64_t k, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        const act_t *wj = w + j * k;
        const float add = bias != NULL ? LD(bias[j]) : 0.0f;
        int64_t m = 0;
        for (; m + 2 <= rows; m += 2) {
            const act_t *x0 = x + m * k, *x1 = x0 + k;
            float s0 = 0.0f, s1 = 0.0f;
#pragma omp simd reduction(+ : s0, s1)
            for (int64_t i = 0; i < k; i++) {
                s0 += LD(x0[i]) * LD(wj[i]);
                s1 += LD(x1[i]) * LD(wj[i]);
            }
            out[m * n + j] = ST(s0 + add + (residual != NULL ? LD(residual[m * n + j]) : 0.0f));
            out[(m + 1) * n + j] = ST(s1 + add + (residual != NULL ? LD(residual[(m + 1) * n + j]) : 0.0f));
        }
        for (; m < rows; m++) {
            const act_t *xm = x + m * k;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < k; i++) s += LD(xm[i]) * LD(wj[i]);
            out[m * n + j] = ST(s + add + (residual != NULL ? LD(residual[m * n + j]) : 0.0f));
        }
    }
}

void shm_linear_few_rows(act_t *out, const act_t *x, const act_t *w, const act_t *bias, const act_t *residual,
                         int64_t rows, int64_t n, int64_t k) {
#if defined(SHM_BF16) && defined(__AVX512BF16__)
    linear_few_rows_dp(out, x, w, bias, residual, rows, n, k);
    return;
#endif
#pragma omp parallel if (n * k >= PARALLEL_MIN_FLOATS)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        shm_linear_rows(out, x, w, bias, residual, rows, n, k, n * t / threads, n * (t + 1) / threads);
    }
}
