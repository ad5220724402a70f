/* The ring's hot path and its memory ordering, with the compiler's C11 atomics.
 *
 * Built at first import by ipc/_native.py (cc -O2 -shared -fPIC) and called through ctypes.
 * Every function takes the base address of the mapped segment; the layout constants must
 * match ipc/ring.py. Ordering (see ring.py for the full argument):
 *   - the producer writes payload + record header, then store-releases `tail`;
 *   - the consumer load-acquires `tail`, reads the record, then store-releases `head`;
 *   - a side that goes to sleep stores its "sleeping" flag, runs a seq_cst fence, and re-reads
 *     the peer's counter; a side that publishes stores its counter, runs a seq_cst fence, and
 *     reads the flag (Dekker), so at least one of them sees the other: no lost wake-up;
 *   - a side that naps (ipc_nap_*) only loads the peer's counter (acquire) between naps and
 *     never sets its flag, so the peer's publish does not post: the nap is a slow spin.
 * __atomic_* builtins are the primitives C11 <stdatomic.h> is built on (gcc and clang); they
 * work on plain shared memory, which _Atomic-qualified objects would not let us name.
 *
 * Built with -DIPC_PYTHON_MODULE (when Python's headers are there), the same library is also a
 * CPython extension module whose functions call the hot ones (push, reserve, commit, peek,
 * release) with METH_FASTCALL; see the end of the file.
 */
#ifdef IPC_PYTHON_MODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#define OFF_CAPACITY 16
#define OFF_MAX_RECORD 24
#define OFF_TAIL 64
#define OFF_P_HEAD_CACHE 72
#define OFF_P_PENDING 80
#define OFF_P_RECORD_POS 88
#define OFF_HEAD 128
#define OFF_C_TAIL_CACHE 136
#define OFF_C_PENDING 144
#define OFF_C_SLEEPING 192
#define OFF_P_SLEEPING 256
#define DATA 4096

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

static inline void write_header(uint8_t *b, uint64_t pos, uint32_t len, uint16_t kind) {
    uint8_t *h = b + DATA + pos;
    uint16_t magic = RECORD_MAGIC;
    memcpy(h, &len, 4);
    memcpy(h + 4, &kind, 2);
    memcpy(h + 6, &magic, 2);
}

/* Wakes the side sleeping on `flag_off` if it announced it sleeps; 1 = post its semaphore. */
static inline int take_sleeper(uint8_t *b, int flag_off) {
    FENCE();
    if (LOAD_RLX(b, flag_off) == 0) return 0;
    return __atomic_exchange_n((uint64_t *)(b + flag_off), 0, __ATOMIC_SEQ_CST) != 0;
}

/* Capacity and record limit are written once by the creator; a garbage value must not divide by 0. */
static inline int bad_geometry(uint8_t *b) {
    uint64_t cap = U64(b, OFF_CAPACITY), max_rec = U64(b, OFF_MAX_RECORD);
    return cap < 64 || (cap & 7) || max_rec < 16 || max_rec > cap / 2;
}

static inline int64_t free_bytes(uint8_t *b, uint64_t tail, uint64_t head, uint64_t cap) {
    if (head > tail || tail - head > cap || (head & 7)) return BAD_COUNTERS;
    return (int64_t)(cap - (tail - head));
}

/* Producer: room for an n-byte payload? Returns the payload's offset from the base, FULL,
 * TOO_BIG or BAD_COUNTERS. Writes a padding record first when the record would cross the end. */
int64_t ipc_reserve(uint8_t *b, int n) {
    uint64_t cap = U64(b, OFF_CAPACITY), rec = align8(8 + (uint64_t)n);
    if (bad_geometry(b)) return BAD_COUNTERS;
    if (n < 0 || rec > U64(b, OFF_MAX_RECORD)) return TOO_BIG;
    uint64_t tail = LOAD_RLX(b, OFF_TAIL), pos = tail % cap, room = cap - pos;
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

/* Producer: publish the reserved record. Returns 1 when the consumer sleeps and must be woken. */
int ipc_commit(uint8_t *b, int n, int kind) {
    write_header(b, U64(b, OFF_P_RECORD_POS), (uint32_t)n, (uint16_t)kind);
    STORE_REL(b, OFF_TAIL, U64(b, OFF_P_PENDING));
    return take_sleeper(b, OFF_C_SLEEPING);
}

/* Producer: reserve + copy + commit of one whole message. FULL/TOO_BIG/BAD_COUNTERS, or 0/1 as commit. */
int64_t ipc_push(uint8_t *b, const uint8_t *data, int n) {
    int64_t off = ipc_reserve(b, n);
    if (off < 0) return off;
    memcpy(b + off, data, (size_t)n);
    return ipc_commit(b, n, KIND_MSG);
}

/* Consumer: the next record, skipping a padding record. Returns EMPTY, a negative BAD_* code, or
 * kind << 60 | length << 30 | payload offset from the base. The record stays in the ring until
 * ipc_release. Validates everything it reads, so a corrupted ring gives an error, not a crash. */
int64_t ipc_peek(uint8_t *b) {
    uint64_t cap = U64(b, OFF_CAPACITY), max_rec = U64(b, OFF_MAX_RECORD);
    if (bad_geometry(b)) return BAD_COUNTERS;
    uint64_t head = LOAD_RLX(b, OFF_HEAD), tail = U64(b, OFF_C_TAIL_CACHE);
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

/* Consumer: free the record returned by ipc_peek. Returns 1 when the producer sleeps for space. */
int ipc_release(uint8_t *b) {
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

/* Spin (called with the GIL released) until there is data / space, for at most ns nanoseconds. */
int ipc_spin_consumer(uint8_t *b, int64_t ns) {
    int64_t deadline = now_ns() + ns;
    for (uint32_t i = 1;; i++) {
        if (has_data(b)) return 1;
        cpu_relax();
        if ((i & 63) == 0) {
            if (now_ns() >= deadline) return has_data(b);
            sched_yield();
        }
    }
}

int ipc_spin_producer(uint8_t *b, int64_t n, int64_t ns) {
    int64_t deadline = now_ns() + ns;
    for (uint32_t i = 1;; i++) {
        if (has_space(b, n)) return 1;
        cpu_relax();
        if ((i & 63) == 0) {
            if (now_ns() >= deadline) return has_space(b, n);
            sched_yield();
        }
    }
}

/* Nap (called with the GIL released) until there is data / space, for at most window_ns:
 * sleep first_ns, re-check, sleep twice as long, re-check, ... with naps capped at max_ns and
 * never past the window. Unlike the spin this leaves the CPU to others between two looks; unlike
 * the semaphore the other side never has to wake us (our "sleeping" flag stays clear, so its
 * publish posts nothing). The re-check is the same acquire load as the spin's. A signal makes
 * it return early (EINTR), so that Python runs its handler; the caller then naps on. */
static int nap_until(uint8_t *b, int64_t n, int space, int64_t window_ns, int64_t first_ns, int64_t max_ns) {
    int64_t end = now_ns() + window_ns, nap = first_ns > 0 ? first_ns : 1;
    for (;;) {
        if (space ? has_space(b, n) : has_data(b)) return 1;
        int64_t left = end - now_ns();
        if (left <= 0) return 0;
        int64_t ns = nap < left ? nap : left;
        struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
        if (clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, NULL) != 0)
            return space ? has_space(b, n) : has_data(b);
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

/* The physical floor: two processes bouncing a counter on one cache line, no ring, no Python.
 * Role 0 sends i and waits for i back, `iters` times; role 1 echoes. Returns elapsed ns, or -1
 * when the other side has not answered for timeout_ns (it died, or never came). The clock is
 * read once per 4096 spins, so it costs the measured loop nothing. */
static inline int await_value(uint64_t *word, uint64_t value, int64_t timeout_ns) {
    int64_t deadline = 0;
    for (uint32_t spins = 1; __atomic_load_n(word, __ATOMIC_ACQUIRE) != value; spins++) {
        cpu_relax();
        if ((spins & 4095) == 0) {
            int64_t now = now_ns();
            if (deadline == 0) deadline = now + timeout_ns;
            else if (now >= deadline) return 0;
        }
    }
    return 1;
}

int64_t ipc_floor_pingpong(uint8_t *b, int64_t off, int64_t iters, int64_t role, int64_t timeout_ns) {
    uint64_t *ping = (uint64_t *)(b + off), *pong = (uint64_t *)(b + off + 64);
    int64_t t0 = now_ns();
    for (uint64_t i = 1; i <= (uint64_t)iters; i++) {
        if (role == 0) {
            __atomic_store_n(ping, i, __ATOMIC_RELEASE);
            if (!await_value(pong, i, timeout_ns)) return -1;
        } else {
            if (!await_value(ping, i, timeout_ns)) return -1;
            __atomic_store_n(pong, i, __ATOMIC_RELEASE);
        }
    }
    return now_ns() - t0;
}

#ifdef IPC_PYTHON_MODULE
/* The hot functions for Python without ctypes: a ctypes call converts its arguments through
 * libffi, ~0.3 us warm and ~10 us right after work that evicted the caches (an engine step);
 * a METH_FASTCALL call is a fraction of that. The base address comes as a Python int. The
 * functions hold the GIL, like ctypes.PyDLL's: they never wait. */
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

#define FASTCALL(name, fn) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, NULL}
static PyMethodDef methods[] = {
    FASTCALL("push", py_push), FASTCALL("reserve", py_reserve), FASTCALL("commit", py_commit),
    FASTCALL("peek", py_peek), FASTCALL("release", py_release), {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ipc_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ipc_fast(void) { return PyModule_Create(&module); }
#endif
