/* The encoders' bidirectional attention over packed sequences, fp32, AVX2 + FMA
 * (model/bert.py's AttentionPlan calls it): softmax(q k^T) v per (sequence, head), with Q
 * pre-scaled, over each sequence's real tokens only (no padding, no mask), optionally within a
 * window of +-w positions (ModernBERT's local layers).
 *
 * Rows of Q, and of K beside V, are heads x head_dim each, as the fused QKV projection writes them. A
 * task is one sequence's group of heads, whose Q, K and V rows are first copied out packed. Per
 * head, its queries are taken QC at a time: their Q is transposed into a [head_dim][lq] panel, so
 * that the scores come transposed, S^T = K Q^T, as register tiles of a small GEMM (K's entries
 * broadcast, 8 queries a vector). The softmax then runs down the columns, 8 queries a vector: the
 * max, the exp (a polynomial inline) and the sum with no horizontal reductions. P.V is a second
 * register-tiled GEMM that broadcasts P^T's entries against V's rows, scaled by each query's
 * 1 / sum as it is stored. A query's arithmetic does not depend on the other queries in its chunk
 * (keys outside its window weigh exactly 0), so one query alone (query_at) gets its row of the
 * full attention bit for bit. Tasks are handed out dynamically (lengths differ). Built with
 * -mavx2 -mfma only. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define QC 64 /* queries per chunk at most: 8 vectors a row of S^T */
#define MASKED (-1e30f)
#define PACK_BYTES (384 * 1024) /* a task's copies of Q, K and V at most (one L2 is 1 MB on Zen 4) */

/* exp(x) for x <= 0 (held at -87, above fp32's underflow): 2^n e^r with |r| <= ln2 / 2, e^r as
 * 1 + r + r^2 c(r), c of degree 4 fitted to exp in float64 (max relative error 6.7e-8 in fp32). */
static inline __m256 exp8(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f); /* 1.5 * 2^23: n lands in the low mantissa bits */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
    const __m256 n = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 c = _mm256_set1_ps(0.0013814612982926365f);
    c = _mm256_fmadd_ps(c, r, _mm256_set1_ps(0.008368709842554736f));
    c = _mm256_fmadd_ps(c, r, _mm256_set1_ps(0.04166838736701293f));
    c = _mm256_fmadd_ps(c, r, _mm256_set1_ps(0.16666520689634973f));
    c = _mm256_fmadd_ps(c, r, _mm256_set1_ps(0.4999999345167989f));
    const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(c, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127 - 0x400000)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(scale));
}

/* S^T rows [0, rows) (keys k + r * head_dim, r < rows <= KR; missing rows repeat the last key and
 * are not stored) by query vectors [0, QV) of the panel qt ([head_dim][lq]) into st (lq a row). */
static inline __attribute__((always_inline)) void scores_tile(const float *k, int64_t rows, const float *qt, int64_t lq,
                                                              int64_t head_dim, float *st, const int KR, const int QV) {
    const float *kr[6];
    __m256 acc[6][3];
    for (int r = 0; r < KR; r++) {
        kr[r] = k + (r < rows ? r : rows - 1) * head_dim;
        for (int v = 0; v < QV; v++) acc[r][v] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < head_dim; d++) {
        __m256 qv[3];
        for (int v = 0; v < QV; v++) qv[v] = _mm256_load_ps(qt + d * lq + 8 * v);
        for (int r = 0; r < KR; r++) {
            const __m256 x = _mm256_broadcast_ss(kr[r] + d);
            for (int v = 0; v < QV; v++) acc[r][v] = _mm256_fmadd_ps(x, qv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < KR; r++)
        if (r < rows)
            for (int v = 0; v < QV; v++) _mm256_store_ps(st + r * lq + 8 * v, acc[r][v]);
}

/* out rows [0, rows) (queries pt[r], r < rows <= QR; missing ones repeat the last), columns
 * [0, 8 DV) = sum over keys j < nk of P^T[j][r] v[j], times inv[r]. */
static inline __attribute__((always_inline)) void pv_tile(const float *pt, int64_t lq, int64_t rows, const float *v, int64_t ldv, int64_t nk,
                                                          const float *inv, float *out, int64_t ldo, const int QR, const int DV) {
    int64_t col[6];
    __m256 acc[6][4];
    for (int r = 0; r < QR; r++) {
        col[r] = r < rows ? r : rows - 1;
        for (int h = 0; h < DV; h++) acc[r][h] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < nk; j++) {
        __m256 vv[4];
        for (int h = 0; h < DV; h++) vv[h] = _mm256_loadu_ps(v + j * ldv + 8 * h);
        for (int r = 0; r < QR; r++) {
            const __m256 p = _mm256_broadcast_ss(pt + j * lq + col[r]);
            for (int h = 0; h < DV; h++) acc[r][h] = _mm256_fmadd_ps(p, vv[h], acc[r][h]);
        }
    }
    for (int r = 0; r < QR; r++)
        if (r < rows) {
            const __m256 s = _mm256_broadcast_ss(inv + r);
            for (int h = 0; h < DV; h++) _mm256_storeu_ps(out + r * ldo + 8 * h, _mm256_mul_ps(acc[r][h], s));
        }
}

/* Query vector v's lanes (queries q0 + 8v + lane) that may see key position j: |j - q| <= window. */
static inline __m256 in_window(int64_t q0, int64_t j, int64_t window) {
    const __m256i diff = _mm256_add_epi32(_mm256_set1_epi32((int)(q0 - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)window + 1), diff),
                                                _mm256_cmpgt_epi32(diff, _mm256_set1_epi32(-(int)window - 1))));
}

/* dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block, rows r >= rows read as zeros. */
static inline void transpose8(const float *src, int64_t lds, int64_t rows, float *dst, int64_t ldd) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = i < rows ? _mm256_loadu_ps(src + i * lds) : _mm256_setzero_ps();
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_store_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_store_ps(dst + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_store_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_store_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_store_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_store_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_store_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_store_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* One chunk of one head: queries [c0, c0 + nq) of a sequence (Q row of query c0 at q) against keys
 * [jlo, jlo + nk) (K row of key jlo at k, V's at v), all packed head_dim floats a row; out: query
 * c0's row. */
static void chunk(const float *q, const float *k, const float *v, int64_t head_dim, int64_t c0, int64_t nq, int64_t jlo,
                  int64_t nk, int64_t window, float *out, int64_t ldo, float *qt, float *st, float *inv) {
    const int64_t nqv = (nq + 7) / 8, lq = 8 * nqv;
    for (int64_t i = 0; i < lq; i += 8)
        for (int64_t d = 0; d < head_dim; d += 8) transpose8(q + i * head_dim + d, head_dim, nq - i, qt + d * lq + i, lq);
    for (int64_t j = 0; j < nk; j += 6) {
        const int64_t rows = nk - j < 6 ? nk - j : 6;
        int64_t w = 0;
        for (; w + 2 <= nqv; w += 2) scores_tile(k + j * head_dim, rows, qt + 8 * w, lq, head_dim, st + j * lq + 8 * w, 6, 2);
        if (w < nqv) scores_tile(k + j * head_dim, rows, qt + 8 * w, lq, head_dim, st + j * lq + 8 * w, 6, 1);
    }
    for (int64_t w = 0; w < nqv; w++) {
        float *s = st + 8 * w;
        const int64_t q0 = c0 + 8 * w;
        __m256 m = _mm256_set1_ps(MASKED), sum = _mm256_setzero_ps();
        if (window < 0) {
            for (int64_t j = 0; j < nk; j++) m = _mm256_max_ps(m, _mm256_load_ps(s + j * lq));
            for (int64_t j = 0; j < nk; j++) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s + j * lq), m));
                _mm256_store_ps(s + j * lq, p);
                sum = _mm256_add_ps(sum, p);
            }
        } else {
            for (int64_t j = 0; j < nk; j++)
                m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(MASKED), _mm256_load_ps(s + j * lq), in_window(q0, jlo + j, window)));
            for (int64_t j = 0; j < nk; j++) {
                const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_load_ps(s + j * lq), m)), in_window(q0, jlo + j, window));
                _mm256_store_ps(s + j * lq, p);
                sum = _mm256_add_ps(sum, p);
            }
        }
        _mm256_store_ps(inv + 8 * w, _mm256_div_ps(_mm256_set1_ps(1.0f), sum));
    }
    for (int64_t i = 0; i < nq; i += 3) {
        const int64_t rows = nq - i < 3 ? nq - i : 3;
        int64_t d0 = 0;
        for (; d0 + 32 <= head_dim; d0 += 32) pv_tile(st + i, lq, rows, v + d0, head_dim, nk, inv + i, out + i * ldo + d0, ldo, 3, 4);
        for (; d0 < head_dim; d0 += 8) pv_tile(st + i, lq, rows, v + d0, head_dim, nk, inv + i, out + i * ldo + d0, ldo, 3, 1);
    }
}

/* dst[h][j][0, head_dim) = src[j * lds + h * head_dim + (0, head_dim)] for rows j < rows and heads
 * h < hn, dst's heads `longest` rows apart; row by row, so that the source streams. */
static void copy_heads(const float *src, int64_t lds, int64_t rows, int64_t hn, int64_t head_dim, int64_t longest, float *dst) {
    for (int64_t j = 0; j < rows; j++)
        for (int64_t h = 0; h < hn; h++)
            for (int64_t d = 0; d < head_dim; d += 8)
                _mm256_store_ps(dst + (h * longest + j) * head_dim + d, _mm256_loadu_ps(src + j * lds + h * head_dim + d));
}

/* kv: [tokens, 2 * heads * head_dim] keys then values at row stride ldkv; q: the queries,
 * heads * head_dim per row at row stride ldq (pre-scaled); cu: num_seqs + 1 cumulative lengths;
 * window: -1 for none, else each query attends to keys at most `window` positions away;
 * out: heads * head_dim per row at row stride ldo. head_dim must be a multiple of 8.
 * query_at NULL: every token queries (q and out have a row per token: q may be the Q columns of
 * the fused QKV rows that kv points into). Else one offset per sequence: only that token of
 * sequence seq queries (every token is still a key), from q row seq into out row seq (the
 * poolers that read one token).
 * Returns 0, or -1 when the per-thread buffers cannot be allocated. */
int shm_encoder_attention(const float *q_all, int64_t ldq, const float *kv, int64_t ldkv, const int64_t *cu,
                          int64_t num_seqs, int64_t heads, int64_t head_dim, int64_t window, float *out, int64_t ldo,
                          const int64_t *query_at) {
    int64_t longest = 0;
    for (int64_t i = 0; i < num_seqs; i++) longest = cu[i + 1] - cu[i] > longest ? cu[i + 1] - cu[i] : longest;
    const int64_t hidden = heads * head_dim;
    /* A task is a sequence's group of heads: its Q, K and V rows are first copied out whole, head by
     * head, each rows stride apart (rows 4.6 KB apart in MiniLM's fused QKV fall into 8 of L1's 64
     * sets, and read in place head by head they came cold from memory: the copy streams them). As
     * many heads a group as keep the copies within PACK_BYTES, in L2. */
    int64_t group = PACK_BYTES / (3 * longest * head_dim * (int64_t)sizeof(float));
    group = group < 1 ? 1 : group > heads ? heads : group;
    const int64_t groups = (heads + group - 1) / group, packed = 3 * group * longest * head_dim;
    /* per thread: the Q^T panel, S^T (a row per key), the queries' 1 / sum, the packed Q, K, V */
    const int64_t per_thread = (head_dim + longest + 1) * QC + packed;
    float *buffers = aligned_alloc(32, (size_t)omp_get_max_threads() * per_thread * sizeof(float));
    if (buffers == NULL) return -1;
#pragma omp parallel
    {
        float *qt = buffers + omp_get_thread_num() * per_thread, *st = qt + head_dim * QC, *inv = st + longest * QC;
        float *qp = inv + QC, *kp = qp + group * longest * head_dim, *vp = kp + group * longest * head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * groups; task++) {
            /* the last sequences first: the runner sorts them by length, and the longest last would
             * leave one thread alone at the end */
            const int64_t seq = num_seqs - 1 - task / groups, h0 = task % groups * group;
            const int64_t hn = heads - h0 < group ? heads - h0 : group, start = cu[seq], len = cu[seq + 1] - start;
            /* queries [q0, q1): every token, or query_at's */
            const int64_t q0 = query_at == NULL ? 0 : query_at[seq], q1 = query_at == NULL ? len : q0 + 1;
            const float *q = q_all + (query_at == NULL ? start : seq) * ldq + h0 * head_dim, *k = kv + start * ldkv + h0 * head_dim;
            copy_heads(q, ldq, q1 - q0, hn, head_dim, longest, qp);
            copy_heads(k, ldkv, len, hn, head_dim, longest, kp);
            copy_heads(k + hidden, ldkv, len, hn, head_dim, longest, vp);
            float *o = out + (query_at == NULL ? start : seq) * ldo + h0 * head_dim;
            for (int64_t hh = 0; hh < hn; hh++)
                for (int64_t c0 = q0; c0 < q1; c0 += QC) {
                    const int64_t nq = q1 - c0 < QC ? q1 - c0 : QC;
                    const int64_t jlo = window < 0 || c0 <= window ? 0 : c0 - window;
                    const int64_t jhi = window < 0 || c0 + nq + window >= len ? len : c0 + nq + window;
                    const int64_t at = hh * longest * head_dim;
                    chunk(qp + at + (c0 - q0) * head_dim, kp + at + jlo * head_dim, vp + at + jlo * head_dim, head_dim, c0, nq, jlo,
                          jhi - jlo, window, o + (c0 - q0) * ldo + hh * head_dim, ldo, qt, st, inv);
                }
        }
    }
    free(buffers);
    return 0;
}
