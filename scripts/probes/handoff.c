// Probe: does handing a filled batch to another thread for the write(2) cost throughput,
// against writing it from the thread that filled it (where the batch is still in cache)?
// One connection, a reader receiving into a 63 MiB rotating buffer, 512 KiB batches of
// 1 KiB messages copied in:
//   mode 0: the filling thread writes each batch itself
//   mode 1: a sender thread writes it (8 buffers, semaphores), as the client's sender does
// Build and run: gcc -O2 -o /tmp/handoff handoff.c -lpthread
//                for i in 1 2 3 4; do /tmp/handoff 0; /tmp/handoff 1; done
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH (512 * 1024)
#define NBUF 8
static const long total = 6L << 30;
static int conn;
static char *bufs[NBUF];
static sem_t filled, freed;

static void *reader(void *arg) {
    int fd = *(int *)arg;
    char *buf = aligned_alloc(4096, 64 << 20);
    long got = 0;
    size_t off = 0;
    while (got < total) {
        ssize_t n = read(fd, buf + off, BATCH);
        if (n <= 0) { perror("read"); exit(1); }
        got += n;
        off = (off + BATCH) % (63 << 20);
    }
    return 0;
}

static void write_all(const char *b) {
    for (size_t o = 0; o < BATCH;) {
        ssize_t n = write(conn, b + o, BATCH - o);
        if (n < 0) { perror("write"); exit(1); }
        o += n;
    }
}

static void *sender(void *unused) {
    (void)unused;
    for (long s = 0, i = 0; s < total; s += BATCH, i++) {
        sem_wait(&filled);
        write_all(bufs[i % NBUF]);
        sem_post(&freed);
    }
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int mode = argc > 1 ? atoi(argv[1]) : 0;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    bind(ls, (void *)&a, sizeof a);
    getsockname(ls, (void *)&a, &l);
    listen(ls, 1);
    conn = socket(AF_INET, SOCK_STREAM, 0);
    connect(conn, (void *)&a, sizeof a);
    int s = accept(ls, 0, 0);
    pthread_t rt, st;
    pthread_create(&rt, 0, reader, &s);
    for (int i = 0; i < NBUF; i++) {
        bufs[i] = aligned_alloc(4096, BATCH);
        memset(bufs[i], 1, BATCH);
    }
    sem_init(&filled, 0, 0);
    sem_init(&freed, 0, NBUF);
    if (mode == 1) pthread_create(&st, 0, sender, 0);
    char msg[1024];
    memset(msg, 7, sizeof msg);
    double t0 = now();
    for (long sent = 0, i = 0; sent < total; sent += BATCH, i++) {
        char *b = bufs[i % NBUF];
        if (mode == 1) sem_wait(&freed);
        for (int o = 0; o < BATCH; o += 1024) { memcpy(b + o, msg, 1024); b[o] = (char)o; }
        if (mode == 1) sem_post(&filled);
        else write_all(b);
    }
    if (mode == 1) pthread_join(st, 0);
    pthread_join(rt, 0);
    printf("mode %d: %.0f MB/s\n", mode, total / (now() - t0) / 1e6);
    return 0;
}
