/* A mixture-of-experts layer's experts, for any number of rows, run by one OpenMP team: what the
 * native decode step runs inside its own team for its few rows, and what the layer path
 * (model/moe.py, `shm_moe_experts`) runs for every other step (a batch of more than the native
 * step's few rows, prefill, tensor parallel). One implementation for both.
 *
 * The caller routes (the layer path's router is torch's, so the choices are transformers' own;
 * the decode step's is its own C softmax top-k); `moe_sort` orders the (row, expert) slots by
 * expert (a counting sort, rows in order within an expert): each chosen expert is a run of slots.
 * Then `moe_team`, on every thread, hands out units through two atomic counters:
 * - gate-up units (run, chunk of the expert's gate-up rows), the run's rows FEW_ROWS at a time
 *   through the GEMV row kernels (quant_kernels.c) while the chunk's weights stay in cache; the
 *   thread that finishes a run's last chunk applies the GLU to the run's rows and marks it ready;
 * - down units (run, chunk of hidden columns), handed out in run order after every gate-up unit:
 *   a unit waits only for its own run's GLU (no barrier between the projections, so a thread
 *   whose last gate-up unit is still running holds up only the expert that unit belongs to);
 *   the thread that finishes a chunk of columns for the last run writes those columns of every
 *   row's weighted sum (+ residual), so no barrier separates the sum from the projections either.
 * Each active expert's weights are read once a call, by whichever thread takes the chunk; experts
 * no row chose are never touched. The sum follows the layer path's torch arithmetic: each expert's
 * output times its routing weight (rounded), added in expert order from zero, then the residual.
 *
 * Included by decode_step.c after its shm_linear tables and row kernels. */

/* A step's slots sorted by expert: each slot's row and weight, each row's slots in expert order
 * (by_row[t * K ..]), and the runs: (first slot, count) and expert of each chosen expert. */
typedef struct {
    int64_t *row, *by_row, (*runs)[2], *run_expert, *filled;
    float *weight;
    int64_t slots, num_runs;
} moe_plan;

/* The plan's floats for `rows` rows of top_k of num_experts (int64s count two). */
static int64_t moe_plan_floats(int64_t rows, int64_t top_k, int64_t num_experts) {
    return 2 * (2 * rows * top_k + 3 * num_experts + rows) + rows * top_k;
}

static moe_plan moe_plan_at(float *buf, int64_t rows, int64_t top_k, int64_t num_experts) {
    const int64_t slots = rows * top_k;
    moe_plan p;
    p.row = (int64_t *)buf;
    p.by_row = p.row + slots;
    p.runs = (int64_t(*)[2])(p.by_row + slots);
    p.run_expert = (int64_t *)(p.runs + num_experts);
    p.filled = p.run_expert + num_experts;
    p.weight = (float *)(p.filled + rows);
    p.slots = slots;
    p.num_runs = 0;
    return p;
}

/* The counting sort of `rows` rows' top_k (ids, weights) into `p` (from moe_plan_at); -2 for an
 * id outside [0, num_experts) (the plan is then unusable). */
static int moe_sort(moe_plan *p, const int64_t *ids, const float *weights, int64_t rows, int64_t K, int64_t E) {
    const int64_t slots = rows * K;
    for (int64_t i = 0; i < slots; i++)
        if (ids[i] < 0 || ids[i] >= E) return -2;
    int64_t(*runs)[2] = p->runs;
    for (int64_t e = 0; e < E; e++) runs[e][1] = 0;
    for (int64_t i = 0; i < slots; i++) runs[ids[i]][1]++;
    for (int64_t e = 0, next = 0; e < E; e++) {
        runs[e][0] = next;
        next += runs[e][1];
    }
    for (int64_t i = 0; i < slots; i++) {
        const int64_t s = runs[ids[i]][0]++;
        p->row[s] = i / K;
        p->weight[s] = weights[i];
    }
    p->num_runs = 0;
    for (int64_t e = 0; e < E; e++) /* runs[e][0] now ends expert e's slots: the runs of the chosen ones */
        if (runs[e][1] > 0) {
            runs[p->num_runs][0] = runs[e][0] - runs[e][1];
            runs[p->num_runs][1] = runs[e][1];
            p->run_expert[p->num_runs++] = e;
        }
    for (int64_t t = 0; t < rows; t++) p->filled[t] = 0;
    for (int64_t s = 0; s < slots; s++) p->by_row[p->row[s] * K + p->filled[p->row[s]]++] = s; /* expert order per row */
    p->slots = slots;
    return 0;
}

/* The int64 synchronisation words `moe_team` needs for `runs` runs and `threads` threads; zeroed
 * by the caller before the team starts. */
static int64_t moe_sync_words(int64_t runs, int64_t threads) { return 32 + 2 * runs + 4 * threads + 1; }

/* Columns [j0, j1) of each row's weighted sum over its experts (slots by_row[t * K ..], in expert
 * order), plus the residual where given: the layer path's torch arithmetic, no fused multiply-add. */
__attribute__((optimize("fp-contract=off"))) static void moe_weighted_sum(float *out, const float *expert_out,
                                                                          const moe_plan *p, const float *residual,
                                                                          int64_t rows, int64_t K, int64_t H, int64_t j0,
                                                                          int64_t j1) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t j = j0; j < j1; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                const int64_t s = p->by_row[t * K + i];
                acc = acc + expert_out[s * H + j] * p->weight[s];
            }
            out[t * H + j] = residual != NULL ? acc + residual[t * H + j] : acc;
        }
}

/* Wait until another thread's release-store makes *flag nonzero: spin a while, then yield the
 * core (on a machine with more threads than cores the awaited thread may need it). */
static void moe_wait(const int64_t *flag) {
    for (int spins = 0; !__atomic_load_n(flag, __ATOMIC_ACQUIRE); spins++) {
        if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* The layer's experts and sizes: per expert gate_up [2 * intermediate, hidden], down [hidden,
 * intermediate] (intermediate: this rank's share of each expert's rows). */
typedef struct {
    const shm_linear *gate_up, *down;
    int64_t hidden, intermediate, top_k;
    glu_fn glu;
} moe_experts;

/* This thread's share of the experts of plan `p` (see the top of the file): xs [slots, hidden],
 * the rows gathered in slot order; gate_up [slots, 2 I], act [slots, I], expert_out [slots,
 * hidden]: the team's shared buffers; out[rows, hidden] = the weighted sums (+ residual; out may
 * be residual); `sync`: moe_sync_words(p->num_runs, team) zeroed words. Returns when this thread
 * finds no unit left: the caller's barrier ends the layer. */
static void moe_team(const shm_model *m, const moe_experts *w, const moe_plan *p, const float *xs, float *gate_up,
                     float *act, float *expert_out, float *out, const float *residual, int64_t rows, int team,
                     int64_t *sync) {
    const int64_t R = p->num_runs, H = w->hidden, I = w->intermediate, K = w->top_k;
    if (R == 0) return;
    int64_t *next_gate_up = sync, *next_down = sync + 16; /* the two unit counters, a cache line apart */
    int64_t *gate_up_done = sync + 32, *ready = gate_up_done + R, *columns_done = ready + R;
    const int64_t step_a = chunk_rows(2 * I, team), per_a = (2 * I + step_a - 1) / step_a;
    for (int64_t c; (c = __atomic_fetch_add(next_gate_up, 1, __ATOMIC_RELAXED)) < R * per_a;) {
        const int64_t r = c / per_a, j0 = (c % per_a) * step_a, j1 = j0 + step_a < 2 * I ? j0 + step_a : 2 * I;
        const int64_t first = p->runs[r][0], count = p->runs[r][1];
        for (int64_t s = first; s < first + count; s += FEW_ROWS) {
            const int64_t group = first + count - s < FEW_ROWS ? first + count - s : FEW_ROWS;
            linear_rows(m, &w->gate_up[p->run_expert[r]], gate_up + s * 2 * I, xs + s * H, NULL, group, j0, j1);
        }
        if (__atomic_add_fetch(&gate_up_done[r], 1, __ATOMIC_ACQ_REL) == per_a) {
            w->glu(act + first * I, gate_up + first * 2 * I, count, I);
            __atomic_store_n(&ready[r], 1, __ATOMIC_RELEASE);
        }
    }
    const int64_t step_b = chunk_rows(H, team), per_b = (H + step_b - 1) / step_b;
    for (int64_t c; (c = __atomic_fetch_add(next_down, 1, __ATOMIC_RELAXED)) < R * per_b;) {
        const int64_t r = c / per_b, chunk = c % per_b, j0 = chunk * step_b, j1 = j0 + step_b < H ? j0 + step_b : H;
        const int64_t first = p->runs[r][0], count = p->runs[r][1];
        moe_wait(&ready[r]);
        for (int64_t s = first; s < first + count; s += FEW_ROWS) {
            const int64_t group = first + count - s < FEW_ROWS ? first + count - s : FEW_ROWS;
            linear_rows(m, &w->down[p->run_expert[r]], expert_out + s * H, act + s * I, NULL, group, j0, j1);
        }
        if (__atomic_add_fetch(&columns_done[chunk], 1, __ATOMIC_ACQ_REL) == R)
            moe_weighted_sum(out, expert_out, p, residual, rows, K, H, j0, j1);
    }
}

typedef struct {
    const shm_linear *gate_up, *down; /* per expert: [2 * intermediate, hidden], [hidden, intermediate] */
    int64_t num_experts, top_k, hidden, intermediate;
    glu_fn glu;
    linear_rows_fn linear_rows; /* plain fp32 parts (cpu_kernels.c's shm_linear_rows) */
} shm_moe;

/* The plan, the synchronisation words (for up to 64 threads), the gathered rows and the
 * projections' outputs. */
int64_t shm_moe_scratch_floats(const shm_moe *moe, int64_t rows) {
    const int64_t slots = rows * moe->top_k, runs = slots < moe->num_experts ? slots : moe->num_experts;
    return moe_plan_floats(rows, moe->top_k, moe->num_experts) + 2 * moe_sync_words(runs, 64) +
           slots * (2 * moe->hidden + 3 * moe->intermediate) + 64;
}

/* out[rows, hidden] = sum over each row's top_k experts (ids [rows, top_k], weights [rows,
 * top_k] fp32) of weight * down(glu(gate_up(x))) (+ residual; out may be residual). `scratch`:
 * shm_moe_scratch_floats(moe, rows) floats. Returns 0; -1 / -3 for a weight the kernels cannot
 * run; -2 for an expert id outside [0, num_experts) (nothing written then). */
int shm_moe_experts(const shm_moe *moe, float *out, const float *x, const float *residual, int64_t rows,
                    const int64_t *ids, const float *weights, float *scratch, int threads) {
    const int64_t E = moe->num_experts, K = moe->top_k, H = moe->hidden, I = moe->intermediate, slots = rows * K;
    if (rows <= 0) return 0;
    threads = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    moe_plan p = moe_plan_at(scratch, rows, K, E);
    int rc = moe_sort(&p, ids, weights, rows, K, E);
    if (rc != 0) return rc;
    for (int64_t r = 0; r < p.num_runs; r++)
        if ((rc = check_linear(&moe->gate_up[p.run_expert[r]])) || (rc = check_linear(&moe->down[p.run_expert[r]]))) return rc;
    int64_t *sync = (int64_t *)(scratch + moe_plan_floats(rows, K, E));
    memset(sync, 0, (size_t)moe_sync_words(p.num_runs, threads) * sizeof(int64_t));
    float *xs = (float *)(sync + moe_sync_words(p.num_runs, threads)), *gate_up = xs + slots * H;
    float *act = gate_up + slots * 2 * I, *expert_out = act + slots * I;
    const moe_experts w = {moe->gate_up, moe->down, H, I, K, moe->glu};
    shm_model m; /* what linear_rows reads of a model: its fp32 row kernel */
    memset(&m, 0, sizeof m);
    m.linear_rows = moe->linear_rows;
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t s = slots * tid / team; s < slots * (tid + 1) / team; s++)
            memcpy(xs + s * H, x + p.row[s] * H, (size_t)H * sizeof(float));
#pragma omp barrier
        moe_team(&m, &w, &p, xs, gate_up, act, expert_out, out, residual, rows, team, sync);
    }
    return 0;
}
