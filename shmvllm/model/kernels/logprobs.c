/* Logprobs of many rows of fp32 logits over the whole vocabulary, in one call per block of rows:
 * for each row, the logprob and rank of a given token, and the top-k tokens and their logprobs.
 *
 * Why: prompt logprobs need this for every prompt position (8k rows of 49k logits for one long
 * prompt). torch does it in five passes over a row (log_softmax's max, sum of exp and subtract,
 * gather, compare-and-count for the rank, topk), each writing or reading a full-size temporary;
 * here it is two passes that only read the row (max and rank count, then the sum of exp), and a
 * third for the top-k that touches only the few 16-wide chunks that can hold a top-k value.
 *
 * The values are torch.log_softmax's formula, (x - max) - log(sum(exp(x - max))), summed in fp32
 * lanes (as torch's vectorized kernel does, in another order: within a few ulp of it). The rank
 * counts the logits above the token's logit (torch's reference counts the logprobs above its
 * logprob: the same but where subtracting the normalizer rounds two logits to one logprob).
 * Top-k: by value, the lower index first among equal values, sorted descending.
 *
 * Built with -march=native and -ffast-math (so that gcc vectorizes the max, the count and expf
 * through libmvec for whatever the CPU has); logits must be finite. Rows are split over OpenMP
 * threads (torch's pool: see cpu_kernels.c).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define CHUNK 16

/* Inserts (value, index) into the descending top list of `count` < k entries or replaces its
 * last entry; returns the new count. Equal values keep the earlier (lower) index first. */
static int64_t top_insert(float *values, int64_t *ids, int64_t count, int64_t k, float value, int64_t index) {
    int64_t at = count < k ? count : k - 1;
    while (at > 0 && values[at - 1] < value) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    values[at] = value;
    ids[at] = index;
    return count < k ? count + 1 : count;
}

static void one_row(const float *x, int64_t vocab, int64_t target, int64_t k, int32_t *out_ids, float *out_lps,
                    int32_t *out_rank, float *top_values, int64_t *top_ids) {
    const float chosen = x[target];
    float max = x[0];
    int64_t above = 0;
#pragma omp simd reduction(max : max) reduction(+ : above)
    for (int64_t i = 0; i < vocab; i++) {
        max = x[i] > max ? x[i] : max;
        above += x[i] > chosen;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < vocab; i++) sum += expf(x[i] - max);
    const float log_sum = logf(sum);

    int64_t count = 0;
    if (k > 0) {
        float floor = 0.0f;  /* the k-th value once k are held (read only then): a chunk must beat it */
        int64_t start = 0;
        for (; start + CHUNK <= vocab; start += CHUNK) {
            float chunk_max = x[start];
#pragma omp simd reduction(max : chunk_max)
            for (int64_t i = start; i < start + CHUNK; i++) chunk_max = x[i] > chunk_max ? x[i] : chunk_max;
            if (count == k && chunk_max <= floor) continue;
            for (int64_t i = start; i < start + CHUNK; i++) {
                if (count < k || x[i] > floor) {
                    count = top_insert(top_values, top_ids, count, k, x[i], i);
                    floor = top_values[count - 1];
                }
            }
        }
        for (int64_t i = start; i < vocab; i++) {
            if (count < k || x[i] > floor) {
                count = top_insert(top_values, top_ids, count, k, x[i], i);
                floor = top_values[count - 1];
            }
        }
    }
    out_ids[0] = (int32_t)target;
    out_lps[0] = (chosen - max) - log_sum;
    for (int64_t j = 0; j < count; j++) {
        out_ids[1 + j] = (int32_t)top_ids[j];
        out_lps[1 + j] = (top_values[j] - max) - log_sum;
    }
    *out_rank = (int32_t)(above + 1);
}

/* logits: [rows, vocab], rows `row_stride` floats apart; targets: [rows] token ids in
 * [0, vocab); k: top-k width, 0 <= k <= max_k. out_ids / out_lps: [rows, 1 + k] (the target,
 * then the top-k); out_ranks: [rows]. scratch_values / scratch_ids: max_k of each per thread, for
 * up to scratch_threads threads. Returns 0, or -1 when an argument is out of range (nothing
 * written). */
int shm_logprob_rows(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride, const int64_t *targets,
                     int64_t k, int64_t max_k, int32_t *out_ids, float *out_lps, int32_t *out_ranks,
                     float *scratch_values, int64_t *scratch_ids, int64_t scratch_threads) {
    if (rows < 0 || vocab < 1 || row_stride < vocab || k < 0 || k > max_k || k > vocab) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (targets[r] < 0 || targets[r] >= vocab) return -1;
    int64_t threads = scratch_threads < omp_get_max_threads() ? scratch_threads : omp_get_max_threads();
    threads = rows < threads ? rows : threads;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads((int)threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t me = omp_get_thread_num();
        one_row(logits + r * row_stride, vocab, targets[r], k, out_ids + r * (1 + k), out_lps + r * (1 + k),
                out_ranks + r, scratch_values + me * max_k, scratch_ids + me * max_k);
    }
    return 0;
}
