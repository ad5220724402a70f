/* A mixture-of-experts layer's experts for any number of rows, in one call and one OpenMP team:
 * what the layer path (model/moe.py) runs for every step the native decode step does not take
 * (a batch of more than its few rows, prefill, tensor parallel).
 *
 * The caller routes (the router's fp32 softmax top-k stays torch's, so the choices are
 * transformers' own); here the (row, expert) slots are sorted by expert (a counting sort, rows in
 * order within an expert), the rows gathered in slot order, and then, with `omp barrier` between
 * the phases: every chosen expert's gate-up projection on its run of rows, the GLU activation,
 * every chosen expert's down projection, and each row's weighted sum over its experts (+ the
 * residual). A projection phase hands out (expert, chunk of output rows) units through one atomic
 * counter, so each active expert's weights are read once a step, by whichever thread takes the
 * chunk, and multiplied into all of its rows (in groups of FEW_ROWS: the GEMV row kernels of
 * quant_kernels.c, the chunk's weights still in cache for the next group); experts no row chose
 * are never touched. The sum follows the layer path's torch arithmetic: each expert's output times
 * its routing weight (rounded), added in expert order from zero, then the residual.
 *
 * Included at the end of decode_step.c: it shares that file's shm_linear tables and part kernels.
 */

typedef struct {
    const shm_linear *gate_up, *down; /* per expert: [2 * intermediate, hidden], [hidden, intermediate] */
    int64_t num_experts, top_k, hidden, intermediate;
    glu_fn glu;
    linear_rows_fn linear_rows; /* plain fp32 parts (cpu_kernels.c's shm_linear_rows) */
} shm_moe;

/* int64s: each slot's expert, row and (per row, in expert order) index, each expert's (first slot,
 * count) and id, each row's slots filled; floats: each slot's weight, gathered row, gate-up
 * outputs, activation and expert output */
int64_t shm_moe_scratch_floats(const shm_moe *moe, int64_t rows) {
    const int64_t slots = rows * moe->top_k;
    return 2 * (3 * slots + 3 * moe->num_experts + rows) + slots * (1 + 2 * moe->hidden + 3 * moe->intermediate) + 64;
}

/* This thread's share of one projection of every chosen expert: (run, chunk of output rows) units
 * from `counter`; a run's rows go through the chunk FEW_ROWS at a time. */
static void moe_team_projection(const shm_model *m, const shm_linear *experts, const int64_t *run_expert,
                                const int64_t (*runs)[2], int64_t num_runs, float *out, const float *in, int threads,
                                int64_t *counter) {
    const int64_t n = experts[run_expert[0]].n, k = experts[run_expert[0]].k;
    const int64_t step = chunk_rows(n, threads), per = (n + step - 1) / step;
    for (int64_t c; (c = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED)) < num_runs * per;) {
        const int64_t run = c / per, j0 = (c % per) * step, j1 = j0 + step < n ? j0 + step : n;
        const int64_t first = runs[run][0], count = runs[run][1];
        for (int64_t s = first; s < first + count; s += FEW_ROWS) {
            const int64_t group = first + count - s < FEW_ROWS ? first + count - s : FEW_ROWS;
            linear_rows(m, &experts[run_expert[run]], out + s * n, in + s * k, NULL, group, j0, j1);
        }
    }
}

/* Columns [j0, j1) of each row's weighted sum over its experts (slots by_row[t * K ..], in expert
 * order), plus the residual where given: the layer path's torch arithmetic, no fused multiply-add. */
__attribute__((optimize("fp-contract=off"))) static void moe_weighted_sum(float *out, const float *expert_out,
                                                                          const float *weight, const int64_t *by_row,
                                                                          const float *residual, int64_t rows, int64_t K,
                                                                          int64_t H, int64_t j0, int64_t j1) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t j = j0; j < j1; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                const int64_t s = by_row[t * K + i];
                acc = acc + expert_out[s * H + j] * weight[s];
            }
            out[t * H + j] = residual != NULL ? acc + residual[t * H + j] : acc;
        }
}

/* out[rows, hidden] = sum over each row's top_k experts (ids [rows, top_k], weights [rows,
 * top_k] fp32) of weight * down(glu(gate_up(x))) (+ residual; out may be residual). `scratch`:
 * shm_moe_scratch_floats(moe, rows) floats. Returns 0; -1 / -3 for a weight the kernels cannot
 * run; -2 for an expert id outside [0, num_experts) (nothing written then). */
int shm_moe_experts(const shm_moe *moe, float *out, const float *x, const float *residual, int64_t rows,
                    const int64_t *ids, const float *weights, float *scratch, int threads) {
    const int64_t E = moe->num_experts, K = moe->top_k, H = moe->hidden, I = moe->intermediate, slots = rows * K;
    if (rows <= 0) return 0;
    for (int64_t i = 0; i < slots; i++)
        if (ids[i] < 0 || ids[i] >= E) return -2;
    int64_t *expert = (int64_t *)scratch, *row = expert + slots, *by_row = row + slots;
    int64_t(*runs)[2] = (int64_t(*)[2])(by_row + slots), *run_expert = (int64_t *)(runs + E), *filled = run_expert + E;
    float *weight = (float *)(filled + rows), *xs = weight + slots, *gate_up = xs + slots * H;
    float *act = gate_up + slots * 2 * I, *expert_out = act + slots * I;
    int64_t counters[2 * 16] = {0}; /* the two projections' counters, a cache line apart */
    /* the counting sort: each expert's first slot, then the slots in (expert, row) order */
    for (int64_t e = 0; e < E; e++) runs[e][1] = 0;
    for (int64_t i = 0; i < slots; i++) runs[ids[i]][1]++;
    int64_t num_runs = 0;
    for (int64_t e = 0, next = 0; e < E; e++) {
        runs[e][0] = next;
        next += runs[e][1];
    }
    for (int64_t i = 0; i < slots; i++) {
        const int64_t s = runs[ids[i]][0]++;
        expert[s] = ids[i];
        row[s] = i / K;
        weight[s] = weights[i];
    }
    for (int64_t e = 0; e < E; e++) /* runs[e][0] now ends expert e's slots: the runs of the chosen ones */
        if (runs[e][1] > 0) {
            runs[num_runs][0] = runs[e][0] - runs[e][1];
            runs[num_runs][1] = runs[e][1];
            run_expert[num_runs++] = e;
        }
    for (int64_t t = 0; t < rows; t++) filled[t] = 0;
    for (int64_t s = 0; s < slots; s++) by_row[row[s] * K + filled[row[s]]++] = s; /* expert order per row */
    for (int64_t r = 0; r < num_runs; r++) {
        int rc;
        if ((rc = check_linear(&moe->gate_up[run_expert[r]])) || (rc = check_linear(&moe->down[run_expert[r]]))) return rc;
    }
    shm_model m; /* what linear_rows reads of a model: its fp32 row kernel */
    memset(&m, 0, sizeof m);
    m.linear_rows = moe->linear_rows;
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t s = slots * tid / team; s < slots * (tid + 1) / team; s++)
            memcpy(xs + s * H, x + row[s] * H, (size_t)H * sizeof(float));
#pragma omp barrier
        if (num_runs > 0) moe_team_projection(&m, moe->gate_up, run_expert, (const int64_t(*)[2])runs, num_runs, gate_up,
                                              xs, team, &counters[0]);
#pragma omp barrier
        {
            const int64_t s0 = slots * tid / team, s1 = slots * (tid + 1) / team;
            if (s1 > s0) moe->glu(act + s0 * I, gate_up + s0 * 2 * I, s1 - s0, I);
        }
#pragma omp barrier
        if (num_runs > 0) moe_team_projection(&m, moe->down, run_expert, (const int64_t(*)[2])runs, num_runs, expert_out,
                                              act, team, &counters[16]);
#pragma omp barrier
        const int64_t cols = (H + team - 1) / team, j0 = tid * cols < H ? tid * cols : H;
        moe_weighted_sum(out, expert_out, weight, by_row, residual, rows, K, H, j0, j0 + cols < H ? j0 + cols : H);
    }
    return 0;
}
