/* The floor of benchmarks/ipc_latency.py (not the ring): the round trip of a bare cache-line
 * ping-pong between two processes, no queue logic and no Python in the loop. A standalone
 * program: it forks, parent and child bounce a counter between two cache lines of a shared
 * anonymous mapping `iters` times per batch, and it prints the mean ns per round trip of each
 * batch, one a line. A side that gets no answer for 10 s gives up (exit status 2). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static void await_value(uint64_t *word, uint64_t value) {
    int64_t deadline = 0;
    for (uint32_t spins = 1; __atomic_load_n(word, __ATOMIC_ACQUIRE) != value; spins++) {
        relax();
        if ((spins & 4095) == 0) {
            int64_t now = now_ns();
            if (deadline == 0) deadline = now + 10000000000LL;
            else if (now >= deadline) _exit(2);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s BATCHES ITERS\n", argv[0]);
        return 1;
    }
    long batches = atol(argv[1]), iters = atol(argv[2]);
    uint64_t *lines = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (lines == MAP_FAILED || batches < 1 || iters < 1) return 1;
    uint64_t *ping = lines, *pong = lines + 8; /* 64 bytes apart: two cache lines */
    pid_t child = fork();
    if (child < 0) return 1;
    uint64_t i = 0;
    for (long batch = 0; batch < batches; batch++) {
        int64_t t0 = now_ns();
        for (long k = 0; k < iters; k++) {
            i++;
            if (child == 0) {
                await_value(ping, i);
                __atomic_store_n(pong, i, __ATOMIC_RELEASE);
            } else {
                __atomic_store_n(ping, i, __ATOMIC_RELEASE);
                await_value(pong, i);
            }
        }
        if (child != 0) printf("%.2f\n", (double)(now_ns() - t0) / iters);
    }
    if (child == 0) _exit(0);
    int status;
    waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 2;
}
