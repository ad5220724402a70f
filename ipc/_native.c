/* The ring's hot path and its memory ordering, with the compiler's C11 atomics.
 *
 * Built at first import by ipc/_native.py (cc -O2 -shared -fPIC) and called through ctypes and,
 * where Python's headers exist, as a CPython extension module (see the end of the file). Every
 * function takes the base address of the mapped segment; the layout constants must match
 * ipc/layout.py (tests/test_ipc_layout.py compares them). Ordering (see ring.py for the full
 * argument):
 *   - the producer writes payload + record header, then store-releases `tail`;
 *   - the consumer load-acquires `tail`, reads the record, then store-releases `head`;
 *   - a side that goes to sleep stores its "sleeping" flag, runs a seq_cst fence, and re-reads
 *     the peer's counter; a side that publishes stores its counter, runs a seq_cst fence, and
 *     reads the flag (Dekker), so at least one of them sees the other: no lost wake-up (the
 *     futex sleep below closes the remaining window, see ring_sleep);
 *   - a side that naps (ipc_nap_*) only loads the peer's counter (acquire) between naps and
 *     never sets its flag, so the peer's publish does not wake it: the nap is a slow spin.
 * __atomic_* builtins are the primitives C11 <stdatomic.h> is built on (gcc and clang); they
 * work on plain shared memory, which _Atomic-qualified objects would not let us name.
 */
#define _GNU_SOURCE /* sched_getcpu */
#ifdef IPC_PYTHON_MODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define OFF_CAPACITY 16
#define OFF_MAX_RECORD 24
#define OFF_TAIL 64
#define OFF_P_CPU 72
#define OFF_P_HEAD_CACHE 128
#define OFF_P_PENDING 136
#define OFF_P_RECORD_POS 144
#define OFF_P_WAKES 152
#define OFF_HEAD 192
#define OFF_C_CPU 200
#define OFF_C_TAIL_CACHE 256
#define OFF_C_PENDING 264
#define OFF_C_WAKES 272
#define OFF_C_SLEEPING 320
#define OFF_P_SLEEPING 384
#define OFF_WAKE 464
#define DATA 4096

#define WAKE_FUTEX 1

#define KIND_MSG 1
#define KIND_FIRST 2
#define KIND_MIDDLE 3
#define KIND_LAST 4
#define KIND_ABORT 5
#define KIND_PAD 6
#define RECORD_MAGIC 0x5A1Fu

#define EMPTY (-1)
#define BAD_COUNTERS (-2)
#define BAD_MAGIC (-3)
#define BAD_KIND (-4)
#define BAD_LENGTH (-5)
#define TRUNCATED (-6)
#define BAD_PAD (-7)
#define FULL (-1)
#define TOO_BIG (-8)

#define U64(b, off) (*(uint64_t *)((b) + (off)))
#define LOAD_ACQ(b, off) __atomic_load_n((uint64_t *)((b) + (off)), __ATOMIC_ACQUIRE)
#define LOAD_RLX(b, off) __atomic_load_n((uint64_t *)((b) + (off)), __ATOMIC_RELAXED)
#define STORE_REL(b, off, v) __atomic_store_n((uint64_t *)((b) + (off)), (v), __ATOMIC_RELEASE)
#define STORE_RLX(b, off, v) __atomic_store_n((uint64_t *)((b) + (off)), (v), __ATOMIC_RELAXED)
#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint64_t align8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

/* 1 + the CPU this thread runs on, 0 where that is unknown. glibc reads it from the rseq area
 * the kernel keeps up to date (a load), or from the vDSO. */
static inline uint64_t this_cpu(void) {
#ifdef __linux__
    int cpu = sched_getcpu();
    return cpu < 0 ? 0 : (uint64_t)cpu + 1;
#else
    return 0;
#endif
}

/* Notes in the counter's line (`off`: OFF_P_CPU next to the tail, OFF_C_CPU next to the head)
 * where the side that is about to publish that counter runs: the other side, waiting, reads it
 * with the counter's line it polls anyway (see spin_until). Written only when it changed. */
static inline void note_cpu(uint8_t *b, int off) {
    uint64_t cpu = this_cpu();
    if (LOAD_RLX(b, off) != cpu) STORE_RLX(b, off, cpu);
}

/* Whether the peer's last publish (its note at `peer_cpu_off`) came from the CPU we run on. */
static inline int peer_beside(uint8_t *b, int peer_cpu_off) {
    uint64_t mine = this_cpu();
    return mine && LOAD_RLX(b, peer_cpu_off) == mine;
}

/* ------------------------------------------------------------------ futex
 * A futex is a 32-bit word in shared memory that a process can sleep on; the kernel wakes it
 * when another process calls ipc_futex_wake on the same word. FUTEX_WAIT compares the word with
 * `expected` and sleeps only if they are equal, atomically with respect to FUTEX_WAKE, which is
 * what makes a lost wake-up impossible when the waker changes the word before it wakes.
 * Shared (not FUTEX_PRIVATE_FLAG): the two sides are different processes. Both functions are
 * generic (any aligned 32-bit word in a shared mapping): other ipc structures use them too. */

/* Sleeps while *word == expected, at most timeout_ns (< 0: no limit). Returns 0 when woken or
 * when the word already differed, 1 on timeout, 2 when a signal interrupted the sleep, -1 where
 * there are no futexes (not Linux). Call it without the GIL. */
int ipc_futex_wait(uint32_t *word, uint32_t expected, int64_t timeout_ns) {
#ifdef __linux__
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        tsp = &ts;
    }
    if (syscall(SYS_futex, word, FUTEX_WAIT, expected, tsp, NULL, 0) == 0) return 0;
    if (errno == ETIMEDOUT) return 1;
    if (errno == EINTR) return 2;
    return 0; /* EAGAIN: the word had changed already */
#else
    (void)word; (void)expected; (void)timeout_ns;
    return -1;
#endif
}

/* Wakes up to n sleepers of `word`; returns how many were woken, -1 where there are no futexes. */
int ipc_futex_wake(uint32_t *word, int n) {
#ifdef __linux__
    long r = syscall(SYS_futex, word, FUTEX_WAKE, n, NULL, NULL, 0);
    return r < 0 ? 0 : (int)r;
#else
    (void)word; (void)n;
    return -1;
#endif
}

/* Set when this process woke the other side out of its futex sleep, or was woken out of its
 * own. Either way the other side is likely queued on this process's CPU: the kernel tends to
 * wake a process on the CPU of the one that woke it. So the next wait gives the CPU away first (sched_yield) instead of
 * spinning on it while the other side waits to run: a round trip with a sleeping peer becomes a
 * hand-over of one CPU, as with a pipe. It costs one sched_yield, and only after a futex wake or
 * wait, which cost a system call already: never on the busy path. One flag per process, not per
 * thread (a thread-local costs a call per look in a shared library): another thread's wake-up
 * costs at worst one needless yield. Relaxed atomics: a hint, ordering nothing. */
static int yield_next_wait;
#define HINT_YIELD() __atomic_store_n(&yield_next_wait, 1, __ATOMIC_RELAXED)

/* The 32-bit half of a u64 flag that holds its value (0 or 1): the futex word of that flag. */
static inline uint32_t *flag_word(uint8_t *b, int64_t flag_off) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)(b + flag_off + 4);
#else
    return (uint32_t *)(b + flag_off);
#endif
}

static inline void write_header(uint8_t *b, uint64_t pos, uint32_t len, uint16_t kind) {
    uint8_t *h = b + DATA + pos;
    uint16_t magic = RECORD_MAGIC;
    memcpy(h, &len, 4);
    memcpy(h + 4, &kind, 2);
    memcpy(h + 6, &magic, 2);
}

/* Called right after publishing a counter: if the side sleeping on `flag_off` announced that it
 * sleeps, clear its flag and (on a futex ring) wake it. Returns 1 when it had to be woken (on a
 * semaphore ring the caller then posts the semaphore), 0 when it was not sleeping. The flag is
 * cleared before the wake, so a sleeper that has not reached FUTEX_WAIT yet finds the word != 1
 * and does not sleep. */
static inline int take_sleeper(uint8_t *b, int flag_off) {
    FENCE();
    if (LOAD_RLX(b, flag_off) == 0) return 0;
    if (__atomic_exchange_n((uint64_t *)(b + flag_off), 0, __ATOMIC_SEQ_CST) == 0) return 0;
    if (LOAD_RLX(b, OFF_WAKE) == WAKE_FUTEX) ipc_futex_wake(flag_word(b, flag_off), 1);
    HINT_YIELD();
    __atomic_fetch_add((uint64_t *)(b + (flag_off == OFF_C_SLEEPING ? OFF_P_WAKES : OFF_C_WAKES)), 1, __ATOMIC_RELAXED);
    return 1;
}

/* For close(): wakes the side sleeping on `flag_off`, whatever the counters say. The caller has
 * stored its "closed" flag before (with a fence): see ring_sleep for why this cannot be lost. */
int ipc_wake_sleeper(uint8_t *b, int64_t flag_off) { return take_sleeper(b, (int)flag_off); }

/* Capacity and record limit are written once by the creator; a garbage value must not divide by 0. */
static inline int bad_geometry(uint8_t *b) {
    uint64_t cap = U64(b, OFF_CAPACITY), max_rec = U64(b, OFF_MAX_RECORD);
    return cap < 64 || (cap & 7) || max_rec < 16 || max_rec > cap / 2;
}

static inline int64_t free_bytes(uint8_t *b, uint64_t tail, uint64_t head, uint64_t cap) {
    if (head > tail || tail - head > cap || (head & 7)) return BAD_COUNTERS;
    return (int64_t)(cap - (tail - head));
}

/* Producer: room for an n-byte payload in a record at `tail` (the published tail, or the end
 * of a batch not yet published)? Returns the payload's offset from the base, FULL, TOO_BIG or
 * BAD_COUNTERS, and notes where the record ends (P_PENDING). Writes a padding record first when
 * the record would cross the end of the buffer. */
static inline int64_t reserve_at(uint8_t *b, uint64_t tail, int n) {
    uint64_t cap = U64(b, OFF_CAPACITY), rec = align8(8 + (uint64_t)n);
    if (bad_geometry(b)) return BAD_COUNTERS;
    if (n < 0 || rec > U64(b, OFF_MAX_RECORD)) return TOO_BIG;
    uint64_t pos = tail % cap, room = cap - pos;
    uint64_t total = rec <= room ? rec : room + rec;
    int64_t free_ = free_bytes(b, tail, U64(b, OFF_P_HEAD_CACHE), cap);
    if (free_ < (int64_t)total) {
        uint64_t head = LOAD_ACQ(b, OFF_HEAD);
        U64(b, OFF_P_HEAD_CACHE) = head;
        free_ = free_bytes(b, tail, head, cap);
        if (free_ < 0) return free_;
        if (free_ < (int64_t)total) return FULL;
    }
    if (rec > room) {
        write_header(b, pos, (uint32_t)(room - 8), KIND_PAD);
        pos = 0;
    }
    U64(b, OFF_P_PENDING) = tail + total;
    U64(b, OFF_P_RECORD_POS) = pos;
    return DATA + pos + 8;
}

int64_t ipc_reserve(uint8_t *b, int n) { return reserve_at(b, LOAD_RLX(b, OFF_TAIL), n); }

/* Producer: writes the header of the reserved record; the next ipc_publish publishes it. */
static inline void seal(uint8_t *b, int n, int kind) { write_header(b, U64(b, OFF_P_RECORD_POS), (uint32_t)n, (uint16_t)kind); }

/* Producer: publishes every sealed record (one release store of the tail, one look at the flag). */
static inline int publish(uint8_t *b) {
    note_cpu(b, OFF_P_CPU);
    STORE_REL(b, OFF_TAIL, U64(b, OFF_P_PENDING));
    return take_sleeper(b, OFF_C_SLEEPING);
}

/* Producer: publish the reserved record. Returns 1 when the consumer slept and was woken. */
int ipc_commit(uint8_t *b, int n, int kind) {
    seal(b, n, kind);
    return publish(b);
}

/* memcpy for the payloads. A destination 1..63 bytes past the source modulo 4 KiB makes a forward
 * copy's loads wait on the stores just before them (4K aliasing): glibc's rep movsb took 10x as
 * long for 64 KiB on this project's AMD EPYC, and 2 KiB pieces of memcpy 2.5x as long for 1 MiB (a
 * payload in the ring is 8 bytes past an aligned record header, so a source at 0..56 bytes past a
 * page boundary does it). Such a copy runs backward in 32-byte vectors: each load then lies below
 * every store before it, and the copy costs what an unaliased memcpy does at every size. */
typedef uint8_t vec32 __attribute__((vector_size(32)));

static inline vec32 load32(const uint8_t *p) {
    vec32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default"))) /* one 32-byte register per vector where there is one */
#endif
static void copy_backward(uint8_t *dst, const uint8_t *src, size_t n) { /* n >= 32, no overlap */
    vec32 head = load32(src), tail = load32(src + n - 32);
    uint8_t *d = (uint8_t *)((uintptr_t)(dst + n) & ~(uintptr_t)31); /* aligned stores from here down */
    const uint8_t *s = src + (d - dst);
    for (; d >= dst + 128; d -= 128, s -= 128) {
        vec32 a = load32(s - 32), b2 = load32(s - 64), c = load32(s - 96), e = load32(s - 128);
        *(vec32 *)(d - 32) = a;
        *(vec32 *)(d - 64) = b2;
        *(vec32 *)(d - 96) = c;
        *(vec32 *)(d - 128) = e;
    }
    for (; d > dst + 32; d -= 32, s -= 32) *(vec32 *)(d - 32) = load32(s - 32);
    memcpy(dst + n - 32, &tail, 32);
    memcpy(dst, &head, 32);
}

static inline void copy_payload(uint8_t *dst, const uint8_t *src, size_t n) {
    uintptr_t d = ((uintptr_t)dst - (uintptr_t)src) & 4095;
    if (n < 64 || d == 0 || d >= 64) {
        memcpy(dst, src, n);
        return;
    }
    copy_backward(dst, src, n);
}

/* Producer: reserve + copy + commit of one whole message. FULL/TOO_BIG/BAD_COUNTERS, or 1 when
 * the consumer slept and was woken, else 0.
 *
 * A message of 16 KiB to 1 MiB wakes a sleeping consumer before it is copied, not after: the
 * consumer's wake-up (tens of µs when its CPU idles) then overlaps the copy (µs to ~100 µs), and
 * the woken consumer spins for the publish (ring_sleep, WOKEN_SPIN_NS). This takes nothing from
 * the handshake: the commit still publishes, fences and looks at the flag, and wakes the consumer
 * again if it went back to sleep meanwhile (a consumer without the C helper does). Smaller
 * messages copy in less time than a wake-up takes; larger ones take longer than the spin. */
#define EARLY_WAKE_MIN 16384
#define EARLY_WAKE_MAX (1 << 20)
int64_t ipc_push(uint8_t *b, const uint8_t *data, int n) {
    int64_t off = ipc_reserve(b, n);
    if (off < 0) return off;
    int woken = n >= EARLY_WAKE_MIN && n <= EARLY_WAKE_MAX ? take_sleeper(b, OFF_C_SLEEPING) : 0;
    copy_payload(b + off, data, (size_t)n);
    return ipc_commit(b, n, KIND_MSG) | woken;
}

/* Consumer: the record at `head` (the published head, or the end of a batch not yet freed),
 * skipping a padding record. Returns EMPTY, a negative BAD_* code, or
 * kind << 60 | length << 30 | payload offset from the base, and notes where the record ends
 * (C_PENDING). Validates everything it reads, so a corrupted ring gives an error, not a crash. */
static inline int64_t peek_at(uint8_t *b, uint64_t head) {
    uint64_t cap = U64(b, OFF_CAPACITY), max_rec = U64(b, OFF_MAX_RECORD);
    if (bad_geometry(b)) return BAD_COUNTERS;
    uint64_t tail = U64(b, OFF_C_TAIL_CACHE);
    if (tail == head) {
        tail = LOAD_ACQ(b, OFF_TAIL);
        U64(b, OFF_C_TAIL_CACHE) = tail;
        if (tail == head) return EMPTY;
    }
    if (head > tail || tail - head > cap || ((head | tail) & 7)) return BAD_COUNTERS;
    uint64_t pos = head % cap, avail = tail - head, skipped = 0;
    uint32_t len;
    uint16_t kind, magic;
    for (int pass = 0; pass < 2; pass++) {
        if (avail < 8) return TRUNCATED;
        memcpy(&len, b + DATA + pos, 4);
        memcpy(&kind, b + DATA + pos + 4, 2);
        memcpy(&magic, b + DATA + pos + 6, 2);
        if (magic != RECORD_MAGIC) return BAD_MAGIC;
        if (kind != KIND_PAD) break;
        if (pass == 1 || pos == 0 || pos + 8 + (uint64_t)len != cap) return BAD_PAD;
        skipped = cap - pos;
        avail -= skipped < avail ? skipped : avail;
        pos = 0;
    }
    if (kind < KIND_MSG || kind > KIND_ABORT) return BAD_KIND;
    uint64_t rec = align8(8 + (uint64_t)len);
    if (rec > max_rec || pos + rec > cap) return BAD_LENGTH;
    if (rec > avail) return TRUNCATED;
    U64(b, OFF_C_PENDING) = head + skipped + rec;
    return ((int64_t)kind << 60) | ((int64_t)len << 30) | (int64_t)(DATA + pos + 8);
}

/* Consumer: the next record (it stays in the ring until ipc_release). */
int64_t ipc_peek(uint8_t *b) { return peek_at(b, LOAD_RLX(b, OFF_HEAD)); }

/* Consumer: free the record returned by ipc_peek (or, after a batch, every record up to
 * C_PENDING). Returns 1 when the producer slept for space and was woken. */
int ipc_release(uint8_t *b) {
    note_cpu(b, OFF_C_CPU);
    STORE_REL(b, OFF_HEAD, U64(b, OFF_C_PENDING));
    return take_sleeper(b, OFF_P_SLEEPING);
}

static inline int has_data(uint8_t *b) {
    return LOAD_ACQ(b, OFF_TAIL) != LOAD_RLX(b, OFF_HEAD);
}

static inline int has_space(uint8_t *b, int64_t n) {
    if (bad_geometry(b)) return 1;
    uint64_t cap = U64(b, OFF_CAPACITY), rec = align8(8 + (uint64_t)n);
    uint64_t tail = LOAD_RLX(b, OFF_TAIL), pos = tail % cap, room = cap - pos;
    uint64_t total = rec <= room ? rec : room + rec;
    int64_t free_ = free_bytes(b, tail, LOAD_ACQ(b, OFF_HEAD), cap);
    return free_ < 0 || free_ >= (int64_t)total;  /* corrupt counters: stop waiting, let reserve say so */
}

static inline int ready(uint8_t *b, int space, int64_t n) { return space ? has_space(b, n) : has_data(b); }

/* Announce sleep, fence, re-check: 1 = the condition already holds (flag withdrawn), 0 = sleep. */
int ipc_arm_consumer(uint8_t *b) {
    __atomic_store_n((uint64_t *)(b + OFF_C_SLEEPING), 1, __ATOMIC_SEQ_CST);
    FENCE();
    if (!has_data(b)) return 0;
    STORE_RLX(b, OFF_C_SLEEPING, 0);
    return 1;
}

int ipc_arm_producer(uint8_t *b, int64_t n) {
    __atomic_store_n((uint64_t *)(b + OFF_P_SLEEPING), 1, __ATOMIC_SEQ_CST);
    FENCE();
    if (!has_space(b, n)) return 0;
    STORE_RLX(b, OFF_P_SLEEPING, 0);
    return 1;
}

void ipc_disarm(uint8_t *b, int flag_off) { STORE_RLX(b, flag_off, 0); }

static int spin_until(uint8_t *b, int space, int64_t n, int64_t ns);
#define WOKEN_SPIN_NS 200000 /* 200 µs: the copy of a 1 MiB message (EARLY_WAKE_MAX), with room */

/* The sleep of a futex ring, in one call (without the GIL): arm the flag, fence, re-check the
 * condition and the peer's "closed" flag, and sleep on the flag's futex word while it is 1, at
 * most timeout_ns. Returns 1 = the condition holds, 2 = the peer closed (the caller looks at it),
 * 0 = not yet (timeout, signal, a wake-up for someone's earlier publish): the caller loops.
 *
 * No lost wake-up. The waker (a publish, or close) stores its counter (or "closed"), runs a
 * seq_cst fence and reads our flag; we store the flag, run a seq_cst fence and read its counter
 * and "closed". Both fences are in the single total order of seq_cst operations, so at least one
 * side sees the other's store: either we see the data / the close and do not sleep, or the waker
 * sees our flag. A waker that sees it exchanges it to 0 *before* FUTEX_WAKE. If we are already
 * inside FUTEX_WAIT, the wake finds us; if not yet, FUTEX_WAIT compares the word with 1 inside
 * the kernel, finds 0 and returns at once. There is no third case: the kernel's compare and
 * sleep are atomic with respect to FUTEX_WAKE on the same word. */
static int ring_sleep(uint8_t *b, int flag_off, int64_t closed_off, int space, int64_t n, int64_t timeout_ns) {
    __atomic_store_n((uint64_t *)(b + flag_off), 1, __ATOMIC_SEQ_CST);
    FENCE();
    if (ready(b, space, n)) {
        STORE_RLX(b, flag_off, 0);
        return 1;
    }
    if (LOAD_ACQ(b, closed_off)) {
        STORE_RLX(b, flag_off, 0);
        return 2;
    }
    int woken = ipc_futex_wait(flag_word(b, flag_off), 1, timeout_ns) == 0;
    STORE_RLX(b, flag_off, 0);
    HINT_YIELD();
    if (ready(b, space, n)) return 1;
    /* A consumer woken with nothing there yet: a producer announced a big message before copying
     * it (see ipc_push), so its publish is due within the copy. Spin for it; 0 after WOKEN_SPIN_NS
     * (the caller sleeps again, and the publish wakes it). A producer is never woken early: one
     * woken to too little space sleeps again at once, as before. */
    return woken && !space && !LOAD_ACQ(b, closed_off) && spin_until(b, 0, 0, WOKEN_SPIN_NS);
}

int ipc_sleep_consumer(uint8_t *b, int64_t closed_off, int64_t timeout_ns) {
    return ring_sleep(b, OFF_C_SLEEPING, closed_off, 0, 0, timeout_ns);
}

int ipc_sleep_producer(uint8_t *b, int64_t n, int64_t closed_off, int64_t timeout_ns) {
    return ring_sleep(b, OFF_P_SLEEPING, closed_off, 1, n, timeout_ns);
}

/* Spin until there is data / space, for at most ns nanoseconds (call it without the GIL):
 * re-check after every pause instruction; read the clock and yield the CPU every 64 checks, so
 * that a peer sharing our core (a loaded machine) gets to run within a couple of µs; and at every
 * check while the peer's last publish came from the CPU we run on (note_cpu): then it can only
 * make progress when we give it that CPU (a scheduler may keep two processes that ping-pong on
 * one CPU), and spinning only delays it. */
static int spin_until(uint8_t *b, int space, int64_t n, int64_t ns) {
    if (ready(b, space, n)) return 1;
    if (__atomic_load_n(&yield_next_wait, __ATOMIC_RELAXED)) {
        __atomic_store_n(&yield_next_wait, 0, __ATOMIC_RELAXED);
        sched_yield();
        if (ready(b, space, n)) return 1;
    }
    int peer_cpu_off = space ? OFF_C_CPU : OFF_P_CPU;
    int beside = peer_beside(b, peer_cpu_off);
    int64_t deadline = 0; /* from the first look at the clock: none in the first 64 checks */
    for (uint32_t i = 1;; i++) {
        cpu_relax();
        if (ready(b, space, n)) return 1;
        if (beside || (i & 63) == 0) {
            int64_t now = now_ns();
            if (deadline == 0) deadline = now + ns;
            else if (now >= deadline) return 0;
            sched_yield();
            if ((i & 63) == 0) beside = peer_beside(b, peer_cpu_off);
        }
    }
}

int ipc_spin_consumer(uint8_t *b, int64_t ns) { return spin_until(b, 0, 0, ns); }

int ipc_spin_producer(uint8_t *b, int64_t n, int64_t ns) { return spin_until(b, 1, n, ns); }

/* Nap (called with the GIL released) until there is data / space, for at most window_ns:
 * sleep first_ns, re-check, sleep twice as long, re-check, ... with naps capped at max_ns and
 * never past the window. Unlike the spin this leaves the CPU to others between two looks; unlike
 * the sleep the other side never has to wake us (our "sleeping" flag stays clear, so its
 * publish wakes nothing). The re-check is the same acquire load as the spin's. A signal makes
 * it return early (EINTR), so that Python runs its handler; the caller then naps on. */
static int nap_until(uint8_t *b, int64_t n, int space, int64_t window_ns, int64_t first_ns, int64_t max_ns) {
    int64_t end = now_ns() + window_ns, nap = first_ns > 0 ? first_ns : 1;
    for (;;) {
        if (ready(b, space, n)) return 1;
        int64_t left = end - now_ns();
        if (left <= 0) return 0;
        int64_t ns = nap < left ? nap : left;
        struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
        if (clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, NULL) != 0) return ready(b, space, n);
        if (nap < max_ns) nap = nap * 2 < max_ns ? nap * 2 : max_ns;
    }
}

int ipc_nap_consumer(uint8_t *b, int64_t window_ns, int64_t first_ns, int64_t max_ns) {
    return nap_until(b, 0, 0, window_ns, first_ns, max_ns);
}

int ipc_nap_producer(uint8_t *b, int64_t n, int64_t window_ns, int64_t first_ns, int64_t max_ns) {
    return nap_until(b, n, 1, window_ns, first_ns, max_ns);
}

uint64_t ipc_load(uint8_t *b, int64_t off) { return LOAD_ACQ(b, off); }

void ipc_store(uint8_t *b, int64_t off, uint64_t v) {
    STORE_REL(b, off, v);
    FENCE();
}

#ifdef IPC_PYTHON_MODULE
/* The hot functions for Python without ctypes: a ctypes call converts its arguments through
 * libffi, ~0.3 us warm and ~10 us right after work that evicted the caches (an engine step);
 * a METH_FASTCALL call is a fraction of that. The base address comes as a Python int. The
 * functions hold the GIL, like ctypes.PyDLL's, except where they wait (take's spin, the sleeps
 * and futex_wait), which they do with the GIL released. */
static int base_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, uint8_t **b) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    *b = (uint8_t *)PyLong_AsVoidPtr(args[0]);
    if (*b != NULL) return 0;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null base address");
    return -1;
}

/* An int argument in [0, INT32_MAX]. */
static int int_arg(PyObject *o, int *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "argument out of range: %lld", v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static PyObject *py_push(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    int n;
    if (base_arg(args, nargs, 3, &b) < 0 || int_arg(args[2], &n) < 0) return NULL;
    if (!PyBytes_Check(args[1]) || n > PyBytes_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "push(base, data: bytes, n <= len(data))");
        return NULL;
    }
    return PyLong_FromLongLong(ipc_push(b, (const uint8_t *)PyBytes_AS_STRING(args[1]), n));
}

static PyObject *py_reserve(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    int n;
    if (base_arg(args, nargs, 2, &b) < 0 || int_arg(args[1], &n) < 0) return NULL;
    return PyLong_FromLongLong(ipc_reserve(b, n));
}

static PyObject *py_commit(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    int n, kind;
    if (base_arg(args, nargs, 3, &b) < 0 || int_arg(args[1], &n) < 0 || int_arg(args[2], &kind) < 0) return NULL;
    return PyLong_FromLong(ipc_commit(b, n, kind));
}

static PyObject *py_peek(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    if (base_arg(args, nargs, 1, &b) < 0) return NULL;
    return PyLong_FromLongLong(ipc_peek(b));
}

static PyObject *py_release(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    if (base_arg(args, nargs, 1, &b) < 0) return NULL;
    return PyLong_FromLong(ipc_release(b));
}

/* Consumer, one call for the common case of pop(): the next whole message as bytes, freed
 * from the ring (waking a producer that sleeps for space: futex rings only). When the ring is
 * empty it spins for up to spin_ns with the GIL released first. Returns the bytes, or the int
 * ipc_peek returned when that is not a whole message (EMPTY after the spin, a fragment, an error):
 * the caller's slow path handles it (the record, if any, is still in the ring). */
/* A new bytes object with the record's payload (copy_payload: the new object's data may alias it). */
static PyObject *bytes_of(uint8_t *b, int64_t r) {
    Py_ssize_t n = (Py_ssize_t)((r >> 30) & 0x3FFFFFFF);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL) copy_payload((uint8_t *)PyBytes_AS_STRING(out), b + (r & 0x3FFFFFFF), (size_t)n);
    return out;
}

static PyObject *take(uint8_t *b, long long spin_ns) {
    int64_t r = ipc_peek(b);
    if (r == EMPTY && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        spin_until(b, 0, 0, spin_ns);
        Py_END_ALLOW_THREADS
        r = ipc_peek(b);
    }
    if (r < 0 || (r >> 60) != KIND_MSG) return PyLong_FromLongLong(r);
    PyObject *data = bytes_of(b, r);
    if (data != NULL) ipc_release(b);
    return data;
}

static PyObject *py_take(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    if (base_arg(args, nargs, 2, &b) < 0) return NULL;
    long long spin_ns = PyLong_AsLongLong(args[1]);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    return take(b, spin_ns);
}

/* The bodies of RingBuffer.push and .pop for the common case, so that a message costs one call
 * from Python (futex rings: the wake-up, if any, happens in C). Bound per ring with
 * functools.partial; what they do not handle they hand to the Python method.
 * `gate` is a bytearray of the ring object: while gate[0] (gate[1]) is nonzero, push (pop) goes
 * to the Python method at once (the ring is closed, or a fragmented message is under way).
 *   push_fast(base, gate, push, ring, data[, timeout]) and try_push_fast, consume_fast: see below.
 *   pop_fast(base, gate, spin_ns, sleep_ns, closed_off, pop, pop_rest, ring[, timeout]): without a
 *     timeout, the whole wait of the common case: peek, spin while empty (spin_ns), then sleep
 *     once (ring_sleep, at most sleep_ns: the poll interval; 0 = no sleep here) and copy out the
 *     message; a result that is not a whole message goes to pop_rest(ring, result, slept),
 *     which looks at the peer first if we slept; with a timeout, pop(ring, timeout). The
 *     Python code after a wake-up (cold caches after a long sleep) is what this saves. 
 * `ring` is a weak proxy, so that the ring does not keep itself alive through its own methods. */
static PyObject *call_with_ring(PyObject *fn, PyObject *ring, PyObject *const *rest, Py_ssize_t nrest, PyObject *kwnames) {
    PyObject *argv[8];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nrest + nkw > 7) {
        PyErr_SetString(PyExc_TypeError, "too many arguments");
        return NULL;
    }
    argv[0] = ring;
    for (Py_ssize_t i = 0; i < nrest + nkw; i++) argv[1 + i] = rest[i];
    return PyObject_Vectorcall(fn, argv, 1 + nrest, kwnames);
}

/* The optional timeout: absent or None -> 1 (the fast path may run). */
static int no_timeout(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t fixed, PyObject *kwnames) {
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) return 0;
    return nargs == fixed || (nargs == fixed + 1 && args[fixed] == Py_None);
}

/* Whether the gate (args[1], a bytearray of 2) lets the fast path of `which` run. */
static int gate_open(PyObject *gate, int which) {
    return PyByteArray_CheckExact(gate) && PyByteArray_GET_SIZE(gate) == 2 && PyByteArray_AS_STRING(gate)[which] == 0;
}

/* Whether a call's keywords are at most "timeout" (which a push that fits now does not need). */
static int only_timeout_kw(PyObject *kwnames) {
    if (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) return 1;
    return PyTuple_GET_SIZE(kwnames) == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout") == 0;
}

/* Pushes `data` (bytes, or a contiguous buffer) if it fits in a record and in the ring now:
 * 1 pushed, 0 not (the caller's method handles it), -1 an error set. */
static int push_now(uint8_t *b, PyObject *data) {
    if (PyBytes_CheckExact(data) && PyBytes_GET_SIZE(data) <= INT32_MAX)
        return ipc_push(b, (const uint8_t *)PyBytes_AS_STRING(data), (int)PyBytes_GET_SIZE(data)) >= 0;
    if (!PyObject_CheckBuffer(data)) return 0; /* a bytearray, a memoryview (of another ring, say) */
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear(); /* not contiguous, released, ...: the method says what is wrong */
        return 0;
    }
    int64_t r = view.len <= INT32_MAX ? ipc_push(b, (const uint8_t *)view.buf, (int)view.len) : FULL;
    PyBuffer_Release(&view);
    return r >= 0;
}

/* push_fast(base, gate, push, ring, data[, timeout]): a message that fits now is pushed here
 * whatever the timeout (it only bounds a wait); anything else is push(ring, data[, timeout]). */
static PyObject *py_push_fast(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    uint8_t *b;
    if (nargs < 4 || base_arg(args, 1, 1, &b) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "push_fast(base, gate, push, ring, ...)");
        return NULL;
    }
    if (nargs >= 5 && nargs <= 6 && gate_open(args[1], 0) && only_timeout_kw(kwnames)) {
        int r = push_now(b, args[4]);
        if (r < 0) return NULL;
        if (r) Py_RETURN_NONE;
    }
    return call_with_ring(args[2], args[3], args + 4, nargs - 4, kwnames);
}

/* try_push_fast(base, gate, try_push, ring, data): True for a message pushed now; anything else
 * is try_push(ring, data) (which may spin for room, and says False when there is none). */
static PyObject *py_try_push_fast(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    uint8_t *b;
    if (nargs < 4 || base_arg(args, 1, 1, &b) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "try_push_fast(base, gate, try_push, ring, ...)");
        return NULL;
    }
    if (nargs == 5 && gate_open(args[1], 0) && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        int r = push_now(b, args[4]);
        if (r < 0) return NULL;
        if (r) Py_RETURN_TRUE;
    }
    return call_with_ring(args[2], args[3], args + 4, nargs - 4, kwnames);
}

/* fn(view) of the whole message `r` (ipc_peek's result), read in place, then its record freed
 * (waking a producer that sleeps for space), also when fn raises. The view is released before
 * the record is freed, so that a use of it afterwards raises instead of reading what the
 * producer writes next; if fn kept an export of it (an array over it), that release raises
 * BufferError, which is then the result (the record is freed all the same). */
static PyObject *release_name;
static PyObject *deliver(uint8_t *b, int64_t r, PyObject *fn) {
    PyObject *view = PyMemoryView_FromMemory((char *)b + (r & 0x3FFFFFFF), (Py_ssize_t)((r >> 30) & 0x3FFFFFFF), PyBUF_WRITE);
    if (view == NULL) return NULL;
    PyObject *out = PyObject_CallOneArg(fn, view);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb); /* fn's exception, if any, set aside during the release */
    PyObject *done = PyObject_CallMethodNoArgs(view, release_name);
    Py_DECREF(view);
    ipc_release(b);
    if (done == NULL) {
        Py_CLEAR(out);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(done);
    PyErr_Restore(type, value, tb);
    return out;
}

/* consume_fast(base, gate, spin_ns, consume, consume_rest, ring, fn[, timeout]): the body of
 * consume (spin_ns >= 0) and try_consume (spin_ns < 0) for the common case, in one call: fn(view)
 * of the next whole message in place (deliver); from try_consume, None when the ring is empty;
 * from consume without a timeout, an empty ring is first spun on for spin_ns with the GIL released
 * (as pop_fast does), and what is there after the spin goes to consume_rest(ring, fn, result).
 * Anything else (a timeout to honour, a fragment, an error, the gate closed) is
 * consume(ring, fn[, timeout]). */
static PyObject *py_consume_fast(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    uint8_t *b;
    if (nargs < 7 || base_arg(args, 1, 1, &b) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "consume_fast(base, gate, spin_ns, consume, consume_rest, ring, fn, ...)");
        return NULL;
    }
    long long spin_ns = PyLong_AsLongLong(args[2]);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    if (nargs <= 8 && gate_open(args[1], 1) && only_timeout_kw(kwnames)) {
        int64_t r = ipc_peek(b);
        if (r >= 0 && (r >> 60) == KIND_MSG) return deliver(b, r, args[6]);
        if (r == EMPTY && spin_ns < 0) Py_RETURN_NONE;
        if (r == EMPTY && spin_ns > 0 && no_timeout(args, nargs, 7, kwnames)) {
            Py_BEGIN_ALLOW_THREADS
            spin_until(b, 0, 0, spin_ns);
            Py_END_ALLOW_THREADS
            r = ipc_peek(b);
            if (r >= 0 && (r >> 60) == KIND_MSG) return deliver(b, r, args[6]);
            PyObject *rest[2] = {args[6], PyLong_FromLongLong(r)};
            if (rest[1] == NULL) return NULL;
            PyObject *out = call_with_ring(args[4], args[5], rest, 2, NULL);
            Py_DECREF(rest[1]);
            return out;
        }
    }
    return call_with_ring(args[3], args[5], args + 6, nargs - 6, kwnames);
}

static PyObject *py_pop_fast(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    uint8_t *b;
    if (nargs < 8 || base_arg(args, 1, 1, &b) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "pop_fast(base, gate, spin_ns, sleep_ns, closed_off, pop, pop_rest, ring, ...)");
        return NULL;
    }
    if (!gate_open(args[1], 1) || !no_timeout(args, nargs, 8, kwnames)) return call_with_ring(args[5], args[7], args + 8, nargs - 8, kwnames);
    long long spin_ns = PyLong_AsLongLong(args[2]), sleep_ns = PyLong_AsLongLong(args[3]), closed_off = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    int64_t r = ipc_peek(b);
    int slept = 0;
    if (r == EMPTY && (spin_ns > 0 || sleep_ns > 0)) {
        int s = 1;
        Py_BEGIN_ALLOW_THREADS
        if (spin_ns <= 0 || !spin_until(b, 0, 0, spin_ns)) {
            s = sleep_ns > 0 ? ring_sleep(b, OFF_C_SLEEPING, closed_off, 0, 0, sleep_ns) : 0;
            slept = sleep_ns > 0;
        }
        Py_END_ALLOW_THREADS
        if (s == 0 && slept && PyErr_CheckSignals() < 0) return NULL;
        r = ipc_peek(b);
    }
    PyObject *out;
    if (r >= 0 && (r >> 60) == KIND_MSG) {
        out = bytes_of(b, r);
        if (out != NULL) ipc_release(b);
        return out;
    }
    PyObject *rest[2] = {PyLong_FromLongLong(r), slept ? Py_True : Py_False};
    if (rest[0] == NULL) return NULL;
    out = call_with_ring(args[6], args[7], rest, 2, NULL);
    Py_DECREF(rest[0]);
    return out;
}

/* Consumer: up to `limit` whole messages (a list of bytes, maybe empty), freed with one release
 * store of the head at the end. Stops before a record that is not a whole message (a fragment,
 * or an error: the caller's pop then sees it). Futex rings only (the wake happens here). */
static PyObject *py_take_many(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    int limit;
    if (base_arg(args, nargs, 2, &b) < 0 || int_arg(args[1], &limit) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    uint64_t head = LOAD_RLX(b, OFF_HEAD), start = head;
    for (int i = 0; i < limit; i++) {
        int64_t r = peek_at(b, head);
        if (r < 0 || (r >> 60) != KIND_MSG) break;
        PyObject *data = bytes_of(b, r);
        if (data == NULL || PyList_Append(out, data) < 0) {
            Py_XDECREF(data);
            Py_DECREF(out);
            out = NULL;
            break;
        }
        Py_DECREF(data);
        head = U64(b, OFF_C_PENDING);
    }
    U64(b, OFF_C_PENDING) = head;
    if (head != start) ipc_release(b);
    return out;
}

/* Producer: pushes the bytes objects of a list from index `start` on, in order, publishing the
 * tail once for all of them (one release store, one look at the consumer's flag), or once per
 * PUBLISH_EVERY bytes when they are long: the consumer then works on the first ones while we
 * copy the next, and frees their space, instead of waiting for the whole batch. When the ring is
 * full it publishes what it has and spins for space (the GIL released) for at most spin_ns.
 * Stops at the first one that does not fit after that (or is not bytes, or is longer than a
 * record: the caller pushes it the slow way). Returns the index it stopped at, as ~index (< 0)
 * when it stopped at a ring still full after the spin (the caller then sleeps without spinning
 * again). Futex rings only (the wake happens here). */
#define PUBLISH_EVERY 65536
static PyObject *py_push_many(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    uint8_t *b;
    if (base_arg(args, nargs, 4, &b) < 0) return NULL;
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "push_many(base, messages: list of bytes, start, spin_ns)");
        return NULL;
    }
    Py_ssize_t done = PyLong_AsSsize_t(args[2]);
    long long spin_ns = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    PyObject *list = args[1];
    uint64_t tail = LOAD_RLX(b, OFF_TAIL), published = tail;
    for (; done >= 0 && done < PyList_GET_SIZE(list); done++) {
        PyObject *item = PyList_GET_ITEM(list, done);
        if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) > INT32_MAX) break;
        int n = (int)PyBytes_GET_SIZE(item);
        int64_t off = reserve_at(b, tail, n);
        if (off == FULL && spin_ns > 0) {
            if (tail != published) {
                publish(b);
                published = tail;
            }
            Py_INCREF(item); /* the list is not ours: another thread may change it while we spin */
            Py_BEGIN_ALLOW_THREADS
            spin_until(b, 1, n, spin_ns);
            Py_END_ALLOW_THREADS
            int changed = done >= PyList_GET_SIZE(list) || PyList_GET_ITEM(list, done) != item;
            Py_DECREF(item);
            if (changed) break;
            off = reserve_at(b, tail, n);
        }
        if (off == FULL) {
            if (tail != published) publish(b);
            return PyLong_FromSsize_t(~done);
        }
        if (off < 0) break;
        copy_payload(b + off, (const uint8_t *)PyBytes_AS_STRING(item), (size_t)n);
        seal(b, n, KIND_MSG);
        tail = U64(b, OFF_P_PENDING);
        if (tail - published >= PUBLISH_EVERY) {
            publish(b);
            published = tail;
        }
    }
    if (tail != published) publish(b);
    return PyLong_FromSsize_t(done);
}

/* The futex sleep of a side (ring_sleep), with the GIL released: sleep_consumer(base, closed_off,
 * timeout_ns), sleep_producer(base, n, closed_off, timeout_ns). A signal ends the sleep (0), and
 * its Python handler runs here: an exception it raises propagates (the flag is already clear). */
static PyObject *py_sleep(PyObject *const *args, Py_ssize_t nargs, int space) {
    uint8_t *b;
    if (base_arg(args, nargs, space ? 4 : 3, &b) < 0) return NULL;
    long long n = 0, closed_off, timeout_ns;
    if (space && (n = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred()) return NULL;
    closed_off = PyLong_AsLongLong(args[nargs - 2]);
    timeout_ns = PyLong_AsLongLong(args[nargs - 1]);
    if (PyErr_Occurred()) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = ring_sleep(b, space ? OFF_P_SLEEPING : OFF_C_SLEEPING, closed_off, space, n, timeout_ns);
    Py_END_ALLOW_THREADS
    if (r == 0 && PyErr_CheckSignals() < 0) return NULL;
    return PyLong_FromLong(r);
}

static PyObject *py_sleep_consumer(PyObject *m, PyObject *const *args, Py_ssize_t nargs) { return py_sleep(args, nargs, 0); }

static PyObject *py_sleep_producer(PyObject *m, PyObject *const *args, Py_ssize_t nargs) { return py_sleep(args, nargs, 1); }

/* futex_wait(address, expected, timeout_ns) -> ipc_futex_wait's result, with the GIL released;
 * a signal's Python handler runs on return (and its exception propagates). futex_wake(address,
 * n) -> how many were woken. `address`: an int, a 4-aligned 32-bit word in a shared mapping. */
static uint32_t *word_arg(PyObject *o) {
    uint32_t *word = (uint32_t *)PyLong_AsVoidPtr(o);
    if (word == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null futex address");
    if (word != NULL && ((uintptr_t)word & 3)) {
        PyErr_Format(PyExc_ValueError, "futex address %p is not 4-byte aligned", (void *)word);
        return NULL;
    }
    return word;
}

static PyObject *py_futex_wait(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "futex_wait(address, expected, timeout_ns): got %zd arguments", nargs);
        return NULL;
    }
    uint32_t *word = word_arg(args[0]);
    if (word == NULL) return NULL;
    unsigned long expected = PyLong_AsUnsignedLong(args[1]);
    long long timeout_ns = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = ipc_futex_wait(word, (uint32_t)expected, timeout_ns);
    Py_END_ALLOW_THREADS
    if (r == 2 && PyErr_CheckSignals() < 0) return NULL;
    return PyLong_FromLong(r);
}

static PyObject *py_futex_wake(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    int n;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "futex_wake(address, n): got %zd arguments", nargs);
        return NULL;
    }
    uint32_t *word = word_arg(args[0]);
    if (word == NULL || int_arg(args[1], &n) < 0) return NULL;
    return PyLong_FromLong(ipc_futex_wake(word, n));
}

#define FASTCALL(name, fn) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, NULL}
static PyMethodDef methods[] = {
    FASTCALL("push", py_push), FASTCALL("reserve", py_reserve), FASTCALL("commit", py_commit),
    FASTCALL("peek", py_peek), FASTCALL("release", py_release), FASTCALL("take", py_take),
    FASTCALL("take_many", py_take_many), FASTCALL("push_many", py_push_many),
    {"push_fast", (PyCFunction)(void (*)(void))py_push_fast, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"pop_fast", (PyCFunction)(void (*)(void))py_pop_fast, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"try_push_fast", (PyCFunction)(void (*)(void))py_try_push_fast, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"consume_fast", (PyCFunction)(void (*)(void))py_consume_fast, METH_FASTCALL | METH_KEYWORDS, NULL},
    FASTCALL("sleep_consumer", py_sleep_consumer), FASTCALL("sleep_producer", py_sleep_producer),
    FASTCALL("futex_wait", py_futex_wait), FASTCALL("futex_wake", py_futex_wake), {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ipc_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ipc_fast(void) {
    release_name = PyUnicode_InternFromString("release");
    return release_name == NULL ? NULL : PyModule_Create(&module);
}
#endif
