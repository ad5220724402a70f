/* The broadcast ring's atomics (ipc/broadcast.py): loads, stores, the fence, and the spins.
 *
 * Built at first use by ipc/broadcast.py (cc -O2 -shared -fPIC, cached like _native.c) and
 * called through ctypes: the short functions keep the GIL (PyDLL), the spins drop it (CDLL).
 * Every function takes the base address of the mapped segment; the offsets must match the
 * layout in broadcast.py. The ordering argument is in broadcast.py's docstring.
 */
#include <stdint.h>
#include <sched.h>
#include <time.h>

#define OFF_TAIL 64
#define OFF_READERS 256
#define READER_STRIDE 128
#define R_HEAD 0
#define R_CLOSED 24

#define LOAD_ACQ(p) __atomic_load_n((uint64_t *)(p), __ATOMIC_ACQUIRE)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

uint64_t bc_load(uint8_t *b, int64_t off) { return LOAD_ACQ(b + off); }

/* A release store followed by a seq_cst fence: the store is ordered after everything before it,
 * and before any later load (the store-load order the sleep/wake handshake needs). */
void bc_store(uint8_t *b, int64_t off, uint64_t v) {
    __atomic_store_n((uint64_t *)(b + off), v, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* 1 if the flag at `off` was set (and clears it), 0 otherwise: at most one post per sleep. */
int bc_take(uint8_t *b, int64_t off) {
    if (!LOAD_ACQ(b + off))
        return 0;
    return __atomic_exchange_n((uint64_t *)(b + off), 0, __ATOMIC_SEQ_CST) != 0;
}

/* The lowest head of the readers that have not closed (UINT64_MAX when all have). */
uint64_t bc_min_head(uint8_t *b, int64_t n) {
    uint64_t low = UINT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *r = b + OFF_READERS + i * READER_STRIDE;
        if (LOAD_ACQ(r + R_CLOSED))
            continue;
        uint64_t head = LOAD_ACQ(r + R_HEAD);
        if (head < low)
            low = head;
    }
    return low;
}

/* Spins (GIL released) for up to ns until ready(b, args) holds: 1 then, 0 when the time is up.
 * Re-checks after every pause instruction; reads the clock and yields the CPU every 64 looks. */
static inline int spin_until(int (*ready)(uint8_t *, const uint64_t *), uint8_t *b, const uint64_t *args, int64_t ns) {
    int64_t deadline = now_ns() + ns;
    for (uint32_t i = 1;; i++) {
        if (ready(b, args))
            return 1;
        cpu_relax();
        if ((i & 63) == 0) {
            if (now_ns() >= deadline)
                return 0;
            sched_yield();
        }
    }
}

/* args: {head}: the tail differs from head. */
static int tail_moved(uint8_t *b, const uint64_t *args) { return LOAD_ACQ(b + OFF_TAIL) != args[0]; }

/* args: {need, n}: every open reader's head is at least need. */
static int heads_reached(uint8_t *b, const uint64_t *args) { return bc_min_head(b, (int64_t)args[1]) >= args[0]; }

/* args: {off, stride, n, value}: each of the n words at off, off + stride, ... is at least value. */
static int all_ge(uint8_t *b, const uint64_t *args) {
    for (uint64_t k = 0; k < args[2]; k++)
        if (LOAD_ACQ(b + args[0] + k * args[1]) < args[3])
            return 0;
    return 1;
}

/* Spins for up to ns: 1 once the tail differs from head. */
int bc_spin_data(uint8_t *b, uint64_t head, int64_t ns) {
    const uint64_t args[] = {head};
    return spin_until(tail_moved, b, args, ns);
}

/* Spins for up to ns: 1 once every open reader's head is at least `need`. */
int bc_spin_space(uint8_t *b, uint64_t need, int64_t n, int64_t ns) {
    const uint64_t args[] = {need, (uint64_t)n};
    return spin_until(heads_reached, b, args, ns);
}

/* Spins for up to ns: 1 once each of the n words at off, off + stride, ... is at least value
 * (the rendezvous of ipc/arena.py). */
int bc_spin_all_ge(uint8_t *b, int64_t off, int64_t stride, int64_t n, uint64_t value, int64_t ns) {
    const uint64_t args[] = {(uint64_t)off, (uint64_t)stride, (uint64_t)(n < 0 ? 0 : n), value};
    return spin_until(all_ge, b, args, ns);
}
