// Probe: how late does this machine wake a sleeping thread, and does a thread that never
// sleeps see the same gaps? It tells stalls of the machine apart from stalls of a program:
// run it alone (idle machine) and next to a benchmark.
//   mode 0: sleep 200 us in a loop; report how much later than asked each sleep ended
//   mode 1: spin on the clock; report the gaps between consecutive readings (time the
//           thread was not running at all although it never blocked)
// Lateness above 3 ms is printed as it happens, with the wall-clock time, so it can be
// lined up with another program's log.
// Build and run: gcc -O2 -o /tmp/wake-hiccups wake-hiccups.c
//                /tmp/wake-hiccups 0 30; /tmp/wake-hiccups 1 30
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

static void report_hiccup(long long late_ns) {
    long long wall = now_ns(CLOCK_REALTIME);
    time_t secs = wall / 1000000000LL;
    struct tm tm;
    gmtime_r(&secs, &tm);
    fprintf(stderr, "late %.1f ms at %02d:%02d:%02d.%03lld UTC\n", late_ns / 1e6, tm.tm_hour,
            tm.tm_min, tm.tm_sec, (wall / 1000000) % 1000);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODE(0 sleep, 1 spin) SECONDS\n", argv[0]);
        return 2;
    }
    int spin = atoi(argv[1]);
    long long end = now_ns(CLOCK_MONOTONIC) + atoll(argv[2]) * 1000000000LL;
    size_t cap = 1 << 20, n = 0;
    long long *late = malloc(cap * sizeof *late);
    const long long asked = 200000;
    long long prev = now_ns(CLOCK_MONOTONIC);
    for (;;) {
        long long l;
        if (spin) {
            long long t = now_ns(CLOCK_MONOTONIC);
            l = t - prev;
            prev = t;
            if (t > end) break;
            if (l < 20000) continue; // ordinary loop iterations: only gaps are kept
        } else {
            long long a = now_ns(CLOCK_MONOTONIC);
            if (a > end) break;
            struct timespec s = {0, asked};
            nanosleep(&s, NULL);
            l = now_ns(CLOCK_MONOTONIC) - a - asked;
        }
        if (l > 3000000) report_hiccup(l);
        if (n == cap) late = realloc(late, (cap *= 2) * sizeof *late);
        late[n++] = l;
    }
    qsort(late, n, sizeof *late, cmp);
    long over1 = 0, over5 = 0;
    for (size_t i = 0; i < n; i++) over1 += late[i] > 1000000, over5 += late[i] > 5000000;
    if (n == 0) {
        printf("%s: no gap above 20 us\n", spin ? "spin" : "sleep");
        return 0;
    }
    printf("%s: %zu %s; p50 %.0f us, p99 %.0f us, p99.9 %.0f us, max %.2f ms; >1 ms: %ld, "
           ">5 ms: %ld\n",
           spin ? "spin" : "sleep", n, spin ? "gaps above 20 us" : "sleeps of 200 us late by",
           late[n / 2] / 1e3, late[n * 99 / 100] / 1e3, late[n * 999 / 1000] / 1e3,
           late[n - 1] / 1e6, over1, over5);
    return 0;
}
