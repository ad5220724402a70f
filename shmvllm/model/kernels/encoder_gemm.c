/* The encoders' fp32 GEMM for AVX2 + FMA CPUs: out = x . W^T + bias, then optionally + residual
 * or GELU, in one pass over the output; and a post-LayerNorm layer's token-wise half (three GEMMs,
 * two LayerNorms) a block of rows at a time (model/encoder_gemm.py packs W and picks this kernel).
 *
 * W is packed once at load time into panels of 16 output columns, each [k][16] contiguous,
 * zero-padded to a whole panel, followed by the bias (padded the same way). A 6x16 register tile
 * (12 ymm accumulators, the 6 rows of x broadcast, two W vectors per k) is swept down a block of
 * MC rows while its W panel (KC x 16 floats) stays in L1 and the block of x (MC x KC) in L2.
 * Rows of x are read in place (no packing): 6 sequential streams per tile. Threads share out the
 * rows (RowDeal below) or, for a short batch, the (row block, panel group) grid. Built with -mavx2 -mfma only, never -march=native, so the
 * code is the AVX2 code whatever the build machine. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 6
#define NR 16
#define MC 48  /* rows per block: 48 x 384 floats of x stay in L2 (benchmarks/results/embed.md) */
#define KC 384 /* the W panel's depth per pass: 384 x 16 floats = 24 KiB, within L1 */
#define STEAL 12 /* rows a thread takes from another's share at a time: two tiles */

/* glibc's libmvec (>= 2.35): 8-wide tanhf, the function gcc itself calls for vectorized loops */
__m256 _ZGVdN8v_tanhf(__m256);

int64_t shm_encoder_packed_floats(int64_t n, int64_t k) {
    const int64_t padded = (n + NR - 1) / NR * NR;
    return padded * k + padded;
}

/* w: [n, k] (an nn.Linear's weight), bias: [n] or NULL -> packed (shm_encoder_packed_floats). */
void shm_encoder_pack(const float *w, const float *bias, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                packed[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    float *packed_bias = packed + panels * NR * k;
    for (int64_t col = 0; col < panels * NR; col++) packed_bias[col] = bias != NULL && col < n ? bias[col] : 0.0f;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

enum { GELU_NONE = 0, GELU_ERF = 1, GELU_TANH = 2 };

/* erf(x) = x P(x^2) / Q(x^2) on |x| <= 4 (erf(4) rounds to 1 in fp32), P and Q of degree 5 fitted
 * to erf in float64 (max error 2.3e-7 evaluated in fp32): half the time of libmvec's erff. */
static inline __m256 erf8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-4.0f)), _mm256_set1_ps(4.0f));
    const __m256 t = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(1.975415216293186e-06f), q = _mm256_set1_ps(3.7485526263481006e-05f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.00028801459120586514f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(0.0012159203179180622f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.0040017045103013515f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(0.015440525487065315f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.053461555391550064f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(0.11645708978176117f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.1962013989686966f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(0.5072101354598999f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.128378987312317f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(1.0f));
    return _mm256_div_ps(_mm256_mul_ps(x, p), q);
}

static inline __m256 gelu8(__m256 x, int gelu) {
    const __m256 half_x = _mm256_mul_ps(_mm256_set1_ps(0.5f), x), one = _mm256_set1_ps(1.0f);
    if (gelu == GELU_ERF) return _mm256_fmadd_ps(half_x, erf8(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f))), half_x);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    return _mm256_mul_ps(half_x, _mm256_add_ps(one, _ZGVdN8v_tanhf(inner)));
}

/* One 6x16 tile over kc steps of k: starts from the bias (first pass over k) or from c (later
 * passes); the last pass adds the residual / applies GELU before the store. Each k step also
 * prefetches into L2 the line at the same offset of `next`, a panel of the same shape: block()
 * passes the next panel to a panel's last tile (its own, already in L1, to the others), so the
 * next panel's first tile finds it in L2 instead of L3 (the token-wise half 2-3% faster). */
static inline void tile(const float *a, int64_t lda, const float *w, int64_t kc, float *c, int64_t ldc, const float *bias,
                        int first, int last, const float *res, int64_t ldr, int gelu, const float *next) {
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    if (first) {
        c00 = c10 = c20 = c30 = c40 = c50 = _mm256_loadu_ps(bias);
        c01 = c11 = c21 = c31 = c41 = c51 = _mm256_loadu_ps(bias + 8);
    } else {
        c00 = _mm256_loadu_ps(c), c01 = _mm256_loadu_ps(c + 8);
        c10 = _mm256_loadu_ps(c + ldc), c11 = _mm256_loadu_ps(c + ldc + 8);
        c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
        c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
        c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
        c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
    }
    const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda;
    for (int64_t kk = 0; kk < kc; kk++) {
        const __m256 w0 = _mm256_load_ps(w + kk * NR), w1 = _mm256_load_ps(w + kk * NR + 8);
        _mm_prefetch((const char *)(next + kk * NR), _MM_HINT_T1);
        __m256 x = _mm256_broadcast_ss(a0 + kk);
        c00 = _mm256_fmadd_ps(x, w0, c00), c01 = _mm256_fmadd_ps(x, w1, c01);
        x = _mm256_broadcast_ss(a1 + kk);
        c10 = _mm256_fmadd_ps(x, w0, c10), c11 = _mm256_fmadd_ps(x, w1, c11);
        x = _mm256_broadcast_ss(a2 + kk);
        c20 = _mm256_fmadd_ps(x, w0, c20), c21 = _mm256_fmadd_ps(x, w1, c21);
        x = _mm256_broadcast_ss(a3 + kk);
        c30 = _mm256_fmadd_ps(x, w0, c30), c31 = _mm256_fmadd_ps(x, w1, c31);
        x = _mm256_broadcast_ss(a4 + kk);
        c40 = _mm256_fmadd_ps(x, w0, c40), c41 = _mm256_fmadd_ps(x, w1, c41);
        x = _mm256_broadcast_ss(a5 + kk);
        c50 = _mm256_fmadd_ps(x, w0, c50), c51 = _mm256_fmadd_ps(x, w1, c51);
    }
    const __m256 acc[2 * MR] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++) {
            __m256 v = acc[2 * i + h];
            if (last && res != NULL) v = _mm256_add_ps(v, _mm256_loadu_ps(res + i * ldr + 8 * h));
            if (last && gelu != GELU_NONE) v = gelu8(v, gelu);
            _mm256_storeu_ps(c + i * ldc + 8 * h, v);
        }
}

/* A tile at the edge (fewer than 6 rows or 16 columns left): through zero-padded copies. */
static void edge_tile(const float *a, int64_t lda, int64_t rows, int64_t cols, const float *w, int64_t kc, float *c,
                      int64_t ldc, const float *bias, int first, int last, const float *res, int64_t ldr, int gelu,
                      const float *next) {
    float ta[MR * KC] __attribute__((aligned(32))), tc[MR * NR], tr[MR * NR];
    memset(ta, 0, sizeof ta);
    memset(tc, 0, sizeof tc);
    memset(tr, 0, sizeof tr);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(ta + r * kc, a + r * lda, kc * sizeof(float));
        memcpy(tc + r * NR, c + r * ldc, cols * sizeof(float));
        if (res != NULL) memcpy(tr + r * NR, res + r * ldr, cols * sizeof(float));
    }
    tile(ta, kc, w, kc, tc, NR, bias, first, last, res != NULL ? tr : NULL, NR, gelu, next);
    for (int64_t r = 0; r < rows; r++) memcpy(c + r * ldc, tc + r * NR, cols * sizeof(float));
}

/* LayerNorm of `rows` rows of n floats in place (row stride ldc): (x - mean) / sqrt(var + eps) * w + b. */
static void layer_norm_rows(float *c, int64_t rows, int64_t n, int64_t ldc, const float *w, const float *b, float eps) {
    const int64_t n8 = n & ~(int64_t)7;
    for (int64_t r = 0; r < rows; r++) {
        float *row = c + r * ldc;
        __m256 acc = _mm256_setzero_ps();
        float sum = 0.0f;
        for (int64_t j = 0; j < n8; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(row + j));
        for (int64_t j = n8; j < n; j++) sum += row[j];
        const float mean = (hsum8(acc) + sum) / (float)n;
        const __m256 mv = _mm256_set1_ps(mean);
        acc = _mm256_setzero_ps(), sum = 0.0f;
        for (int64_t j = 0; j < n8; j += 8) {
            const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(row + j), mv);
            acc = _mm256_fmadd_ps(d, d, acc);
        }
        for (int64_t j = n8; j < n; j++) sum += (row[j] - mean) * (row[j] - mean);
        const float rstd = 1.0f / sqrtf((hsum8(acc) + sum) / (float)n + eps);
        const __m256 rv = _mm256_set1_ps(rstd);
        for (int64_t j = 0; j < n8; j += 8) {
            const __m256 y = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv), rv);
            _mm256_storeu_ps(row + j, _mm256_fmadd_ps(y, _mm256_loadu_ps(w + j), _mm256_loadu_ps(b + j)));
        }
        for (int64_t j = n8; j < n; j++) row[j] = (row[j] - mean) * rstd * w[j] + b[j];
    }
}

/* Rows [m0, m1) by panels [p0, p1) of out, every pass over k. */
static void block(const float *x, int64_t k, int64_t ldx, const float *packed, int64_t n, const float *res, int64_t ldr,
                  float *out, int64_t ldo, int gelu, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    const int64_t panels = (n + NR - 1) / NR;
    const float *packed_bias = packed + panels * NR * k;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        const int first = k0 == 0, last = k0 + kc == k;
        for (int64_t p = p0; p < p1; p++) {
            const float *w = packed + (p * k + k0) * NR, *bias = packed_bias + p * NR;
            const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            for (int64_t i = m0; i < m1; i += MR) {
                const float *a = x + i * ldx + k0, *r = res != NULL ? res + i * ldr + p * NR : NULL;
                float *c = out + i * ldo + p * NR;
                const float *next = i + 2 * MR > m1 && p + 1 < p1 ? w + k * NR : w;
                if (i + MR <= m1 && cols == NR)
                    tile(a, ldx, w, kc, c, ldo, bias, first, last, r, ldr, gelu, next);
                else
                    edge_tile(a, ldx, m1 - i < MR ? m1 - i : MR, cols, w, kc, c, ldo, bias, first, last, r, ldr, gelu, next);
            }
        }
    }
}

/* Rows dealt to a team: each thread owns an equal share of whole MR-row tiles, which it works
 * through front to back MC rows at a time; a thread done with its own share takes STEAL-row
 * chunks from the back of another's, so that a thread slowed by another process hands its last
 * rows over instead of holding up the team at the region's end (a static split waits for its
 * slowest thread). A share is one word, front << 32 | back (rows < 2^32), changed by
 * compare-and-swap. */
typedef struct {
    uint64_t *shares;
    int64_t threads;
} RowDeal;

/* Inside the team: every thread's share set up, visible to all after the single's barrier. */
static void deal_rows(RowDeal *deal, uint64_t *shares, int64_t m) {
#pragma omp single
    {
        const int64_t threads = omp_get_num_threads(), tiles = (m + MR - 1) / MR;
        for (int64_t t = 0; t < threads; t++) {
            const uint64_t r0 = tiles * t / threads * MR, r1 = t + 1 == threads ? m : tiles * (t + 1) / threads * MR;
            shares[t] = r0 << 32 | r1;
        }
        deal->shares = shares, deal->threads = threads;
    }
}

/* The calling thread's next rows [*r0, *r1): from the front of its own share, else from the back
 * of another's; false when every share is done. */
static int next_rows(RowDeal *deal, int64_t *r0, int64_t *r1) {
    const int64_t self = omp_get_thread_num();
    for (int64_t i = 0; i < deal->threads; i++) {
        uint64_t *share = deal->shares + (self + i) % deal->threads, cur = __atomic_load_n(share, __ATOMIC_RELAXED), next;
        int64_t front, back, cut;
        do {
            front = (int64_t)(cur >> 32), back = (int64_t)(cur & 0xffffffffu);
            if (front >= back) break;
            if (i == 0) /* own share: from the front */
                cut = back - front <= MC ? back : front + MC;
            else /* another's: a few tiles from its back, cut on a tile boundary */
                cut = back - front <= STEAL ? front : (back - STEAL) / MR * MR;
            next = i == 0 ? (uint64_t)cut << 32 | (uint64_t)back : (uint64_t)front << 32 | (uint64_t)cut;
        } while (!__atomic_compare_exchange_n(share, &cur, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
        if (front >= back) continue;
        *r0 = i == 0 ? front : cut, *r1 = i == 0 ? cut : back;
        return 1;
    }
    return 0;
}

/* out[m, n] (row stride ldo) = x[m, k] (row stride ldx) . W^T + bias, then + residual[m, n] (row
 * stride ldr; NULL for none) or GELU (0 none, 1 erf, 2 tanh). packed: shm_encoder_pack's.
 * out must not overlap x or residual (k > KC passes store partial sums into out). */
void shm_encoder_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n, const float *res,
                      int64_t ldr, float *out, int64_t ldo, int gelu) {
    const int64_t panels = (n + NR - 1) / NR, blocks = (m + MC - 1) / MC;
    if (blocks >= 8) {
        RowDeal deal;
        uint64_t shares[omp_get_max_threads()];
#pragma omp parallel
        {
            int64_t r0, r1;
            deal_rows(&deal, shares, m);
            while (next_rows(&deal, &r0, &r1)) block(x, k, ldx, packed, n, res, ldr, out, ldo, gelu, r0, r1, 0, panels);
        }
        return;
    }
    /* Few row blocks (a short batch): the panels are split too, so that every thread has work. */
    const int64_t groups = panels < 8 ? panels : 8;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < blocks * groups; item++) {
        const int64_t m0 = item / groups * MC, m1 = m0 + MC < m ? m0 + MC : m, g = item % groups;
        block(x, k, ldx, packed, n, res, ldr, out, ldo, gelu, m0, m1, panels * g / groups, panels * (g + 1) / groups);
    }
}

/* LayerNorm of m rows (row stride ldc) in place, the rows shared out by the threads. */
static void layer_norm_team(float *c, int64_t m, int64_t n, int64_t ldc, const float *w, const float *b, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) layer_norm_rows(c + i * ldc, 1, n, ldc, w, b, eps);
}

/* The token-wise half of a post-LayerNorm encoder layer (BERT's), over m rows:
 *   y = LN1(attn . Wo^T + bo + x),  out = LN2(GELU(y . Wu^T + bu) . Wd^T + bd + y)
 * (attn, x, out: hidden floats a row at their row strides; the MLP inter wide; LN1 and LN2 with
 * weights n1w / n2w, biases n1b / n2b, epsilon eps). Each thread runs its share of the rows a block
 * of MC rows at a time, so that y and the MLP's activation stay in L2 (written out and read back
 * between three GEMMs they cost 2-7% of the MLP's time). out may be x: a block reads its rows of
 * x before it writes them. Returns 0, or -1 when the per-thread buffers cannot be allocated. */
int shm_encoder_token_wise(const float *attn, int64_t lda, const float *x, int64_t ldx, int64_t m, int64_t hidden,
                           int64_t inter, const float *packed_o, const float *n1w, const float *n1b, const float *packed_up,
                           int gelu, const float *packed_down, const float *n2w, const float *n2b, float eps, float *out,
                           int64_t ldo) {
    if ((m + MC - 1) / MC < 8) { /* a short batch: three GEMMs, each splitting its panels between the threads */
        float *y = malloc((size_t)m * (hidden + inter) * sizeof(float)), *h = y + m * hidden;
        if (y == NULL) return -1;
        shm_encoder_gemm(attn, m, hidden, lda, packed_o, hidden, x, ldx, y, hidden, GELU_NONE);
        layer_norm_team(y, m, hidden, hidden, n1w, n1b, eps);
        shm_encoder_gemm(y, m, hidden, hidden, packed_up, inter, NULL, 0, h, inter, gelu);
        shm_encoder_gemm(h, m, inter, inter, packed_down, hidden, y, hidden, out, ldo, GELU_NONE);
        layer_norm_team(out, m, hidden, ldo, n2w, n2b, eps);
        free(y);
        return 0;
    }
    const int64_t per_thread = MC * (hidden + inter);
    float *buffers = aligned_alloc(32, (size_t)omp_get_max_threads() * per_thread * sizeof(float));
    if (buffers == NULL) return -1;
    RowDeal deal;
    uint64_t shares[omp_get_max_threads()];
#pragma omp parallel
    {
        int64_t m0, r1;
        float *y = buffers + omp_get_thread_num() * per_thread, *h = y + MC * hidden;
        deal_rows(&deal, shares, m);
        while (next_rows(&deal, &m0, &r1)) {
            const int64_t rows = r1 - m0;
            block(attn + m0 * lda, hidden, lda, packed_o, hidden, x + m0 * ldx, ldx, y, hidden, GELU_NONE, 0, rows, 0, (hidden + NR - 1) / NR);
            layer_norm_rows(y, rows, hidden, hidden, n1w, n1b, eps);
            block(y, hidden, hidden, packed_up, inter, NULL, 0, h, inter, gelu, 0, rows, 0, (inter + NR - 1) / NR);
            block(h, inter, inter, packed_down, hidden, y, hidden, out + m0 * ldo, ldo, GELU_NONE, 0, rows, 0, (hidden + NR - 1) / NR);
            layer_norm_rows(out + m0 * ldo, rows, hidden, ldo, n2w, n2b, eps);
        }
    }
    free(buffers);
    return 0;
}
