// Probe: what does waking a thread that sleeps on a futex cost the thread that wakes it?
// (The doorbells in the region are futexes; the sequencer rings one per broker per epoch.)
// A waiter sleeps in FUTEX_WAIT; every 0.5 ms the main thread bumps the word and times
// its FUTEX_WAKE system call alone. Tracers add their own cost to every system call, so
// this times the call from inside the program instead.
// Build and run: gcc -O2 -o /tmp/futex-wake futex-wake.c -lpthread && /tmp/futex-wake 3000
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static _Atomic unsigned word, waiting;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *waiter(void *arg) {
    (void)arg;
    for (;;) {
        unsigned seen = atomic_load(&word);
        atomic_store(&waiting, 1);
        syscall(SYS_futex, &word, FUTEX_WAIT, seen, NULL, NULL, 0);
        atomic_store(&waiting, 0);
    }
    return NULL;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3000;
    long long *took = malloc(n * sizeof *took);
    pthread_t t;
    pthread_create(&t, NULL, waiter, NULL);
    for (int i = 0; i < n; i++) {
        struct timespec pause = {0, 500000};
        nanosleep(&pause, NULL);
        while (!atomic_load(&waiting)) {
        }
        usleep(50); // let it reach FUTEX_WAIT after announcing itself
        atomic_fetch_add(&word, 1);
        long long start = now_ns();
        syscall(SYS_futex, &word, FUTEX_WAKE, 1, NULL, NULL, 0);
        took[i] = now_ns() - start;
    }
    qsort(took, n, sizeof *took, cmp);
    printf("FUTEX_WAKE of a sleeping thread, %d wakes: p50 %.1f us, p90 %.1f us, p99 %.1f us\n", n,
           took[n / 2] / 1e3, took[n * 9 / 10] / 1e3, took[n * 99 / 100] / 1e3);
    return 0;
}
