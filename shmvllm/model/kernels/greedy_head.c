/* The greedy decode burst's lm_head on Q8_0 weights (a tied GGUF embedding), exact by construction.
 *
 * Only the argmax of the logits is needed. A cheap pass computes every row's approximate logit A_j
 * from x in ONE int8 piece per block of 32 (x ~ dx_b a_i, dx_b = max |x| / 127 over the block: one
 * integer dot product a block, memory-bound, where the exact rows take fp32 FMAs); with it a bound
 * B_j >= |E_j - A_j| on the distance to the exact kernel's logit E_j:
 *
 *   |E_j - A_j| <= |sum_i w_ji r_i| + |E_j - T_j| + |A_j - A~_j|   (T_j the real dot product, r = x - dx a,
 *                                                                   A~_j the approximation in real arithmetic)
 *              <= ||w_j|| (||r|| + (k + 64) 2^-21 ||x||)           (Cauchy-Schwarz; the rounding of both kernels)
 *
 * Each kernel's fp32 rounding is at most (k + 2) 2^-24 sum_i |w_ji x_i| <= (k + 2) 2^-24 ||w_j|| ||x||
 * whatever its summation order (the approximate pass's integers are exact), so the second term holds
 * both four times over; ||w_j|| is the row's norm, computed in double and rounded up (one float a row:
 * 0.6% of the rows' bytes); ||r|| and ||x|| are summed in double per token, exactly as the piece
 * holds x. Every row with A_j + B_j >= L = max_k (A_k - B_k) is a candidate: a row outside cannot
 * reach the exact logit of the row that gave L, so the first largest exact logit is among them,
 * and the candidates are recomputed with the exact rows the non-burst path runs (the build's
 * q8_0_range: the same bits) and the first of the largest taken. Masked ids (min_tokens) are -inf
 * before L is taken. A non-finite x, or no finite A_k - B_k, takes the exact rows on every row.
 * Measured on SmolLM2's hidden states: 2 candidates a token median, 26 at most, of 49,152.
 */

#define HEAD_GATHER 8 /* candidate rows recomputed together (one split of x for the exact rows) */

/* The first index of the largest of x[j0, j1) into *index, its value into *best; a NaN counts as the
 * largest and the first NaN wins (numpy's argmax). */
static void argmax_range(const float *x, int64_t j0, int64_t j1, float *best, int64_t *index) {
    int64_t at = j0;
    float top = x[j0];
    for (int64_t j = j0 + 1; j < j1 && top == top; j++)
        if (x[j] > top || x[j] != x[j]) top = x[at = j];
    *best = top;
    *index = at;
}

/* The chunk whose argmax is the whole range's: the first of the chunks' largest (or first NaN) best[c]. */
static int64_t chunks_argmax(const float *best, int64_t chunks) {
    float top;
    int64_t c;
    argmax_range(best, 0, chunks, &top, &c);
    return c;
}

/* x's one piece per block: xa[i] = round(x[i] / dx[b]), dx[b] = max |x| / 127 over block b; returns the
 * bound's factor ||x - dx a|| + (k + 64) 2^-21 ||x|| (rounded up), or -1 where x has a NaN or infinity */
static float head_split(const float *x, int64_t k, int8_t *xa, float *dx) {
    double rr = 0.0, xx = 0.0;
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float v = fabsf(xb[i]);
            if (!(v <= 3.4028235e38f)) return -1.0f;
            amax = v > amax ? v : amax;
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) {
            long a = lrintf(xb[i] * inv);
            a = a > 127 ? 127 : a < -127 ? -127 : a; /* never taken (|x| inv <= 127 (1 + 2^-22)); r below is a's own */
            xa[32 * b + i] = (int8_t)a;
            /* exact in double: a d has at most 32 significant bits, x - a d spans at most 34 */
            const double r = (double)xb[i] - (double)a * (double)d;
            rr += r * r;
            xx += (double)xb[i] * (double)xb[i];
        }
        dx[b] = d;
    }
    return (float)((sqrt(rr) + ldexp((double)(k + 64), -21) * sqrt(xx)) * (1.0 + 1e-6));
}

#if defined(__AVX2__) && !defined(INT8_Q8_ROWS)
#define HEAD_APPROX 1
/* the 8 rows' block sums, row r in lane r, from s[r] (row r's partial sums in 8 lanes) */
static inline __m256i sum_rows8(const __m256i s[8]) {
    const __m256i t01 = _mm256_hadd_epi32(s[0], s[1]), t23 = _mm256_hadd_epi32(s[2], s[3]);
    const __m256i t45 = _mm256_hadd_epi32(s[4], s[5]), t67 = _mm256_hadd_epi32(s[6], s[7]);
    const __m256i u0 = _mm256_hadd_epi32(t01, t23), u1 = _mm256_hadd_epi32(t45, t67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* Approximate logits out[j0, j1) of the Q8_0 rows at w: sum_b d_jb dx_b sum_i q_i a_i, 8 rows a pass (row
 * r's block read whole, its 32 products summed in a vector, the 8 rows' sums gathered into lanes), then
 * one convert and one FMA per block for the 8 rows. |q| times a with q's sign (vpsignb): pairs <= 2 * 128 *
 * 127, so vpmaddubsw does not saturate. */
static void head_approx(const int8_t *xa, const float *dx, int64_t blocks, const uint8_t *w, int64_t row_bytes,
                        int64_t j0, int64_t j1, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t j = j0; j < j1; j += 8) {
        const int rows = j1 - j < 8 ? (int)(j1 - j) : 8;
        const uint8_t *row[8];
        for (int r = 0; r < 8; r++) row[r] = w + (j + (r < rows ? r : rows - 1)) * row_bytes;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            /* 8 rows read a block at a time defeat the hardware prefetcher: the group two ahead in step, into
             * L2 (prefetcht1; into L1 this pass read memory at 24-30 GB/s with 2 threads instead of 40-47) */
            for (int l = 0; l < 5; l++) __builtin_prefetch(w + (j + 16) * row_bytes + 272 * b + 64 * l, 0, 2);
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xa + 32 * b));
            __m256i s[8];
            for (int r = 0; r < 8; r++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(row[r] + 34 * b + 2));
                s[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xb, q)), ones);
            }
            const __m256i total = sum_rows8(s);
            const __m128i dh = _mm_setr_epi16((short)load_u16(row[0] + 34 * b), (short)load_u16(row[1] + 34 * b),
                                              (short)load_u16(row[2] + 34 * b), (short)load_u16(row[3] + 34 * b),
                                              (short)load_u16(row[4] + 34 * b), (short)load_u16(row[5] + 34 * b),
                                              (short)load_u16(row[6] + 34 * b), (short)load_u16(row[7] + 34 * b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(_mm256_cvtph_ps(dh), _mm256_set1_ps(dx[b])), acc);
        }
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(out + j, live, acc);
    }
}

/* max over [j0, j1) of approx[j] - norms[j] factor: no exact logit there is below it (NaN: skipped) */
static float head_floor(const float *approx, const float *norms, float factor, int64_t j0, int64_t j1) {
    float top = -INFINITY;
    for (int64_t j = j0; j < j1; j++) {
        const float low = approx[j] - norms[j] * factor;
        top = low > top ? low : top;
    }
    return top;
}

/* The candidates of [j0, j1) (approx[j] + norms[j] factor >= cut, or NaN) recomputed exactly by `range`
 * on rows of the Q8_0 weight w gathered HEAD_GATHER at a time (masked[0, num_masked) set to -inf as the
 * exact path does); the first index of the largest exact logit into *index, its value into *best (the
 * first NaN wins); -inf at j0 where there is none */
static void head_recheck(range_fn range, const float *x, int64_t k, const uint8_t *w, int64_t row_bytes,
                         const float *approx, const float *norms, float factor, float cut, const int64_t *masked,
                         int64_t num_masked, int64_t j0, int64_t j1, float *best, int64_t *index) {
    uint8_t rows[HEAD_GATHER * row_bytes];
    int64_t ids[HEAD_GATHER];
    float exact[HEAD_GATHER];
    float top = -INFINITY;
    int64_t at = j0;
    for (int64_t j = j0, n = 0; j < j1 || n > 0;) {
        if (j < j1) {
            if (!(approx[j] + norms[j] * factor < cut)) {
                memcpy(rows + n * row_bytes, w + j * row_bytes, (size_t)row_bytes);
                ids[n++] = j;
            }
            j++;
            if (n < HEAD_GATHER && j < j1) continue;
        }
        if (n == 0) break;
        range(1, exact, n, x, k, rows, row_bytes, NULL, NULL, 0, 0, n, k);
        for (int64_t i = 0; i < n; i++)
            for (int64_t e = 0; e < num_masked; e++)
                if (masked[e] == ids[i]) exact[i] = -INFINITY;
        /* ids ascend: a later row replaces the best only when larger (or the first NaN) */
        for (int64_t i = 0; i < n && top == top; i++)
            if (exact[i] > top || exact[i] != exact[i]) top = exact[i], at = ids[i];
        n = 0;
    }
    *best = top;
    *index = at;
}

/* One thread's share of the greedy lm_head, called by every thread of a team (it holds a barrier): the
 * Q8_0 weight w [n, k] (rows row_bytes apart), its row norms (shm_q8_0_row_norms), x [k]; the rows in
 * `chunks` chunks of `step` taken from *counter; masked[0, num_masked) never picked. Each chunk c's first
 * largest exact logit and its index land in best[c], index[c]; floors: `chunks` floats shared by the team. */
static void greedy_head_team(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *norms,
                             const float *x, const int64_t *masked, int64_t num_masked, float *logits, int64_t step,
                             int64_t chunks, int64_t *counter, float *floors, float *best, int64_t *index) {
    format_fns fns;
    lookup(T_Q8_0, &fns);
    int8_t xa[k];
    float dx[k / 32];
    const float factor = head_split(x, k, xa, dx);
    int64_t mine[chunks], taken = 0;
    for (int64_t c; (c = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED)) < chunks;) {
        const int64_t j0 = c * step, j1 = (c + 1) * step < n ? (c + 1) * step : n;
        mine[taken++] = c;
        floors[c] = -INFINITY;
        if (factor < 0.0f) continue; /* x not finite: every row exact, below */
        head_approx(xa, dx, k / 32, w, row_bytes, j0, j1, logits);
        for (int64_t e = 0; e < num_masked; e++)
            if (masked[e] >= j0 && masked[e] < j1) logits[masked[e]] = -INFINITY;
        floors[c] = head_floor(logits, norms, factor, j0, j1);
    }
#pragma omp barrier
    float cut = -INFINITY;
    for (int64_t c = 0; c < chunks; c++) cut = floors[c] > cut ? floors[c] : cut;
    for (int64_t t = 0; t < taken; t++) {
        const int64_t c = mine[t], j0 = c * step, j1 = (c + 1) * step < n ? (c + 1) * step : n;
        if (cut > -INFINITY) {
            head_recheck(fns.range, x, k, w, row_bytes, logits, norms, factor, cut, masked, num_masked, j0, j1,
                         &best[c], &index[c]);
            continue;
        }
        fns.range(1, logits, n, x, k, w, row_bytes, NULL, NULL, 0, j0, j1, k);
        for (int64_t e = 0; e < num_masked; e++)
            if (masked[e] >= j0 && masked[e] < j1) logits[masked[e]] = -INFINITY;
        argmax_range(logits, j0, j1, &best[c], &index[c]);
    }
}
#endif

/* The greedy head alone on `threads` threads (the burst runs greedy_head_team in its own team): the first
 * index of the largest exact logit x @ w^T with masked[0, num_masked) excluded, as the exact rows and
 * numpy's argmax give it; `work`: 2 n + 4 threads + 4 floats. Returns it, or -1 for bad sizes, -2 in a
 * build without the approximate pass (the VNNI build's exact rows read as fast, the portable build has
 * none). */
int64_t shm_greedy_head(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *norms,
                        const float *x, const int64_t *masked, int64_t num_masked, int threads, float *work) {
#ifdef HEAD_APPROX
    if (n <= 0 || k % 32 != 0 || row_bytes < k / 32 * 34 || threads <= 0) return -1;
    const int64_t step = ((n + threads - 1) / threads + 7) / 8 * 8, chunks = (n + step - 1) / step;
    int64_t *index = (int64_t *)work, counter = 0;
    float *best = work + 2 * chunks, *floors = best + chunks, *logits = floors + chunks;
#pragma omp parallel num_threads(threads)
    greedy_head_team(w, row_bytes, n, k, norms, x, masked, num_masked, logits, step, chunks, &counter, floors, best,
                     index);
    return index[chunks_argmax(best, chunks)];
#else
    (void)w, (void)row_bytes, (void)n, (void)k, (void)norms, (void)x, (void)masked, (void)num_masked, (void)threads,
        (void)work;
    return -2;
#endif
}

/* ||w_j|| of each Q8_0 row j < n of k values (rows row_bytes apart) into norms[j], computed in double and
 * rounded up to float (+inf where a scale is not finite): the greedy head's bound. Returns 0; -1 for a k
 * that is not a multiple of 32 or rows shorter than their blocks; -2 in a build without the greedy head. */
int shm_q8_0_row_norms(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, float *norms) {
#ifndef HEAD_APPROX
    (void)w, (void)row_bytes, (void)n, (void)k, (void)norms;
    return -2;
#else
    if (k % 32 != 0 || row_bytes < k / 32 * 34) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        double sum = 0.0;
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *blk = w + j * row_bytes + 34 * b;
            int32_t qq = 0;
            for (int i = 0; i < 32; i++) qq += (int32_t)(int8_t)blk[2 + i] * (int8_t)blk[2 + i];
            const double d = fp16_to_fp32(load_u16(blk));
            sum += d * d * qq;
        }
        const double norm = sqrt(sum) * (1.0 + 1e-6);
        norms[j] = norm == norm ? (float)norm : INFINITY;
    }
    return 0;
#endif
}
