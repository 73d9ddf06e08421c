// Probe: how much of the loopback ceiling is the cache? `embarcadero bench --ceilings`
// receives every chunk into the same 512 KiB buffer (it stays in cache); a broker receives
// into its log, memory it has not touched for a while. N streams (sender and reader thread
// each, TCP_NODELAY, 4 MiB socket buffers, as the ceiling), 1 GiB each, readers receiving
// into a rotating buffer of RING MiB per stream: 1 (in cache) or 192 (a broker's log in
// the default region: 24 segments of 8 MiB).
// Build and run: gcc -O2 -o /tmp/log-ceiling log-ceiling.c -lpthread
//                for i in 1 2 3; do /tmp/log-ceiling 4 1; /tmp/log-ceiling 4 192; done
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (512 * 1024)
#define MAX_STREAMS 8
static const long per_stream = 1L << 30;
static long ring;
static pthread_barrier_t rings_ready;

static void *reader(void *arg) {
    int fd = (int)(long)arg;
    char *buf = mmap(0, ring, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buf == MAP_FAILED) { perror("mmap"); exit(1); }
    pthread_barrier_wait(&rings_ready);
    long got = 0;
    size_t off = 0;
    while (got < per_stream) {
        size_t want = CHUNK < ring - off ? CHUNK : ring - off;
        ssize_t n = read(fd, buf + off, want);
        if (n <= 0) { perror("read"); exit(1); }
        got += n;
        off += n;
        if (off >= (size_t)ring) off = 0;
    }
    return 0;
}

static void *sender(void *arg) {
    int fd = (int)(long)arg;
    char *b = malloc(CHUNK);
    memset(b, 1, CHUNK);
    for (long s = 0; s < per_stream;) {
        ssize_t n = write(fd, b, CHUNK);
        if (n < 0) { perror("write"); exit(1); }
        s += n;
    }
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int streams = argc > 1 ? atoi(argv[1]) : 4;
    ring = (argc > 2 ? atol(argv[2]) : 192) << 20;
    if (streams < 1 || streams > MAX_STREAMS || ring < CHUNK) {
        fprintf(stderr, "usage: log-ceiling STREAMS(1-%d) RING_MIB(>=1)\n", MAX_STREAMS);
        return 2;
    }
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    bind(ls, (void *)&a, sizeof a);
    getsockname(ls, (void *)&a, &l);
    listen(ls, MAX_STREAMS);
    pthread_t r[MAX_STREAMS], s[MAX_STREAMS];
    int tx[MAX_STREAMS], rx[MAX_STREAMS], one = 1, size = 4 << 20;
    for (int i = 0; i < streams; i++) {
        tx[i] = socket(AF_INET, SOCK_STREAM, 0);
        connect(tx[i], (void *)&a, sizeof a);
        rx[i] = accept(ls, 0, 0);
        setsockopt(tx[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(rx[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        for (int k = 0; k < 2; k++) {
            int fd = k ? rx[i] : tx[i];
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
            setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
        }
    }
    // The readers' rings are mapped and populated before the clock starts.
    pthread_barrier_init(&rings_ready, 0, streams + 1);
    for (int i = 0; i < streams; i++) pthread_create(&r[i], 0, reader, (void *)(long)rx[i]);
    pthread_barrier_wait(&rings_ready);
    double t0 = now();
    for (int i = 0; i < streams; i++) pthread_create(&s[i], 0, sender, (void *)(long)tx[i]);
    for (int i = 0; i < streams; i++) {
        pthread_join(s[i], 0);
        pthread_join(r[i], 0);
    }
    printf("streams %d ring %ld MiB: %.0f MB/s\n", streams, ring >> 20, streams * per_stream / (now() - t0) / 1e6);
    return 0;
}
