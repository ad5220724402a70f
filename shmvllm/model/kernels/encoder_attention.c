/* The encoders' bidirectional attention over packed sequences, fp32, AVX2 + FMA
 * (model/bert.py's AttentionPlan calls it): softmax(q k^T) v per (sequence, head), with Q
 * pre-scaled, over each sequence's real tokens only (no padding, no mask), optionally within a
 * window of +-w positions (ModernBERT's local layers).
 *
 * Rows of Q, and of K beside V, are heads x head_dim each, as the fused QKV projection writes them. A
 * task is one (sequence, head): its K is transposed into a [head_dim][length] buffer, so that a
 * query's scores come 8 keys per vector with one broadcast of q[d] per FMA, 4 queries sharing
 * each K load; the softmax runs on glibc's vector expf; P.V accumulates head_dim / 8 vectors
 * per query. Tasks are handed out dynamically (lengths differ). Built with -mavx2 -mfma only. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define QR 4 /* queries per pass over K^T */

__m256 _ZGVdN8v_expf(__m256);

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Scores of QR queries (q[r]: head_dim floats each) against keys [j0, j1) (j0 a multiple of 8,
 * j1 rounded up to 8 inside kt's zero padding) into s[r * lds + j]; 16 keys a pass where there
 * are, so that 8 independent FMA chains hide the FMA latency. */
static void scores(const float *const q[QR], const float *kt, int64_t ldk, int64_t head_dim, int64_t j0, int64_t j1,
                   float *s, int64_t lds) {
    int64_t j = j0;
    for (; j + 16 <= j1; j += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t d = 0; d < head_dim; d++) {
            const __m256 k = _mm256_loadu_ps(kt + d * ldk + j), l = _mm256_loadu_ps(kt + d * ldk + j + 8);
            __m256 x = _mm256_broadcast_ss(q[0] + d);
            a0 = _mm256_fmadd_ps(x, k, a0), b0 = _mm256_fmadd_ps(x, l, b0);
            x = _mm256_broadcast_ss(q[1] + d);
            a1 = _mm256_fmadd_ps(x, k, a1), b1 = _mm256_fmadd_ps(x, l, b1);
            x = _mm256_broadcast_ss(q[2] + d);
            a2 = _mm256_fmadd_ps(x, k, a2), b2 = _mm256_fmadd_ps(x, l, b2);
            x = _mm256_broadcast_ss(q[3] + d);
            a3 = _mm256_fmadd_ps(x, k, a3), b3 = _mm256_fmadd_ps(x, l, b3);
        }
        _mm256_storeu_ps(s + j, a0), _mm256_storeu_ps(s + j + 8, b0);
        _mm256_storeu_ps(s + lds + j, a1), _mm256_storeu_ps(s + lds + j + 8, b1);
        _mm256_storeu_ps(s + 2 * lds + j, a2), _mm256_storeu_ps(s + 2 * lds + j + 8, b2);
        _mm256_storeu_ps(s + 3 * lds + j, a3), _mm256_storeu_ps(s + 3 * lds + j + 8, b3);
    }
    for (; j < j1; j += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < head_dim; d++) {
            const __m256 k = _mm256_loadu_ps(kt + d * ldk + j);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(q[0] + d), k, a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(q[1] + d), k, a1);
            a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(q[2] + d), k, a2);
            a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(q[3] + d), k, a3);
        }
        _mm256_storeu_ps(s + j, a0);
        _mm256_storeu_ps(s + lds + j, a1);
        _mm256_storeu_ps(s + 2 * lds + j, a2);
        _mm256_storeu_ps(s + 3 * lds + j, a3);
    }
}

/* One query: softmax over s[lo, hi) (s is 8-aligned from j0 = lo & ~7 up to hi rounded up; the
 * entries outside [lo, hi) are masked here), then out[0, head_dim) = P . V / sum. */
/* s[j, j + 8) with the lanes outside [lo, hi) set to -1e30, masked in registers: scalar stores
 * into a vector the next load reads whole would stall its store forwarding, once per query. */
static inline __m256 load_masked(const float *s, int64_t j, int64_t lo, int64_t hi) {
    const __m256 x = _mm256_loadu_ps(s + j);
    if (j >= lo && j + 8 <= hi) return x;
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32((int)j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)lo - 1)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32((int)hi), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(-1e30f), x, _mm256_castsi256_ps(in));
}

static void softmax_pv(float *s, int64_t lo, int64_t hi, const float *v, int64_t ldv, int64_t head_dim, float *out) {
    const int64_t j0 = lo & ~(int64_t)7, j1 = (hi + 7) & ~(int64_t)7;
    __m256 m = _mm256_set1_ps(-1e30f);
    for (int64_t j = j0; j < j1; j += 8) m = _mm256_max_ps(m, load_masked(s, j, lo, hi));
    const __m256 mx = _mm256_set1_ps(hmax8(m)), floor = _mm256_set1_ps(-87.0f);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; j += 8) {
        /* held above expf's underflow, whose scalar fallback is slow: a masked key's ~1e-38 is
         * lost in the sum (>= 1) and never weighs a V row (the P.V loop skips it) */
        const __m256 p = _ZGVdN8v_expf(_mm256_max_ps(_mm256_sub_ps(load_masked(s, j, lo, hi), mx), floor));
        _mm256_storeu_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    /* 32 columns of V at a time in two sets of accumulators (even and odd keys): 8 FMA chains;
     * a head_dim not a multiple of 32 ends with 8 columns at a time */
    int64_t d0 = 0;
    for (; d0 + 32 <= head_dim; d0 += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t j = lo;
        for (; j + 1 < hi; j += 2) {
            const __m256 p = _mm256_broadcast_ss(s + j), r = _mm256_broadcast_ss(s + j + 1);
            const float *vj = v + j * ldv + d0, *vk = vj + ldv;
            a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), a0), b0 = _mm256_fmadd_ps(r, _mm256_loadu_ps(vk), b0);
            a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), a1), b1 = _mm256_fmadd_ps(r, _mm256_loadu_ps(vk + 8), b1);
            a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), a2), b2 = _mm256_fmadd_ps(r, _mm256_loadu_ps(vk + 16), b2);
            a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), a3), b3 = _mm256_fmadd_ps(r, _mm256_loadu_ps(vk + 24), b3);
        }
        if (j < hi) {
            const __m256 p = _mm256_broadcast_ss(s + j);
            const float *vj = v + j * ldv + d0;
            a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), a0), a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), a1);
            a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), a2), a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), a3);
        }
        _mm256_storeu_ps(out + d0, _mm256_mul_ps(_mm256_add_ps(a0, b0), inv));
        _mm256_storeu_ps(out + d0 + 8, _mm256_mul_ps(_mm256_add_ps(a1, b1), inv));
        _mm256_storeu_ps(out + d0 + 16, _mm256_mul_ps(_mm256_add_ps(a2, b2), inv));
        _mm256_storeu_ps(out + d0 + 24, _mm256_mul_ps(_mm256_add_ps(a3, b3), inv));
    }
    for (; d0 < head_dim; d0 += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = lo; j < hi; j++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j), _mm256_loadu_ps(v + j * ldv + d0), a);
        _mm256_storeu_ps(out + d0, _mm256_mul_ps(a, inv));
    }
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
    const int64_t ldk = (longest + 7) & ~(int64_t)7, hidden = heads * head_dim;
    /* per thread: K^T (padded with zeros to whole vectors), then QR rows of scores */
    const int64_t per_thread = (head_dim + QR) * ldk;
    float *buffers = aligned_alloc(32, (size_t)omp_get_max_threads() * per_thread * sizeof(float));
    if (buffers == NULL) return -1;
#pragma omp parallel
    {
        float *kt = buffers + omp_get_thread_num() * per_thread, *s = kt + head_dim * ldk;
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < num_seqs * heads; task++) {
            const int64_t seq = task / heads, h = task % heads, start = cu[seq], len = cu[seq + 1] - start;
            const float *k = kv + start * ldkv + h * head_dim, *v = k + hidden;
            /* q: the row of the sequence's first query */
            const float *q = q_all + (query_at == NULL ? start : seq) * ldq + h * head_dim;
            const int64_t lp = (len + 7) & ~(int64_t)7;
            for (int64_t d = 0; d < head_dim; d++) {
                for (int64_t j = 0; j < len; j++) kt[d * ldk + j] = k[j * ldkv + d];
                for (int64_t j = len; j < lp; j++) kt[d * ldk + j] = 0.0f;
            }
            /* queries [q0, q1): every token, or the one query_at names */
            const int64_t q0 = query_at == NULL ? 0 : query_at[seq], q1 = query_at == NULL ? len : q0 + 1;
            for (int64_t i = q0; i < q1; i += QR) {
                /* the last pass repeats the last query where fewer than QR are left */
                const float *rows[QR];
                for (int r = 0; r < QR; r++) rows[r] = q + ((i + r < q1 ? i + r : q1 - 1) - q0) * ldq;
                const int64_t lo = window < 0 || i <= window ? 0 : i - window;
                const int64_t last = i + QR - 1 < q1 ? i + QR - 1 : q1 - 1;
                const int64_t hi = window < 0 || last + window + 1 >= len ? len : last + window + 1;
                scores(rows, kt, ldk, head_dim, lo & ~(int64_t)7, (hi + 7) & ~(int64_t)7, s, ldk);
                for (int r = 0; r < QR && i + r < q1; r++) {
                    const int64_t qi = i + r;
                    const int64_t qlo = window < 0 || qi <= window ? 0 : qi - window;
                    const int64_t qhi = window < 0 || qi + window + 1 >= len ? len : qi + window + 1;
                    const int64_t row = query_at == NULL ? start + qi : seq;
                    softmax_pv(s + r * ldk, qlo, qhi, v, ldkv, head_dim, out + row * ldo + h * head_dim);
                }
            }
        }
    }
    free(buffers);
    return 0;
}
