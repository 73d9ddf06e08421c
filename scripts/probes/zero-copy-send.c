// Probe: would a zero-copy publisher send pay off on loopback? One connection, a reader
// thread receiving into a 63 MiB rotating buffer (as a broker receives into its log), and
// the writer sending 512 KiB batches of 1 KiB messages three ways:
//   mode 0: copy the messages into the batch, then write(2)          (what the client does)
//   mode 1: copy the messages into the batch, then vmsplice + splice  (no copy into the socket)
//   mode 2: write(2) a prepared batch, no message copy                (the ceiling's shape)
// Mode 1 reuses its 8 buffers without waiting for the reader: fine for a throughput probe,
// not for a product, which would have to hold each buffer until the batch is acknowledged.
// Build and run: gcc -O2 -o /tmp/zero-copy-send zero-copy-send.c -lpthread
//                for i in 1 2 3; do for m in 2 0 1; do /tmp/zero-copy-send $m; done; done
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define BATCH (512 * 1024)
#define NBUF 8
static const long total = 4L << 30;

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

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void write_all(int fd, const char *b, size_t len) {
    for (size_t o = 0; o < len;) {
        ssize_t n = write(fd, b + o, len - o);
        if (n < 0) { perror("write"); exit(1); }
        o += n;
    }
}

static void splice_all(int pipe_in, int pipe_out, int fd, char *b, size_t len) {
    struct iovec iov = {b, len};
    while (iov.iov_len) {
        ssize_t n = vmsplice(pipe_in, &iov, 1, 0);
        if (n < 0) { perror("vmsplice"); exit(1); }
        iov.iov_base = (char *)iov.iov_base + n;
        iov.iov_len -= n;
        for (ssize_t m = n; m;) {
            ssize_t k = splice(pipe_out, 0, fd, 0, m, SPLICE_F_MOVE);
            if (k < 0) { perror("splice"); exit(1); }
            m -= k;
        }
    }
}

int main(int argc, char **argv) {
    int mode = argc > 1 ? atoi(argv[1]) : 0;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    bind(ls, (void *)&a, sizeof a);
    getsockname(ls, (void *)&a, &l);
    listen(ls, 1);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    connect(c, (void *)&a, sizeof a);
    int s = accept(ls, 0, 0);
    pthread_t th;
    pthread_create(&th, 0, reader, &s);
    char *bufs[NBUF];
    for (int i = 0; i < NBUF; i++) {
        bufs[i] = aligned_alloc(4096, BATCH);
        memset(bufs[i], 1, BATCH);
    }
    char msg[1024];
    memset(msg, 7, sizeof msg);
    int p[2];
    if (pipe(p) || fcntl(p[1], F_SETPIPE_SZ, 1 << 20) < 0) { perror("pipe"); exit(1); }
    double t0 = now();
    for (long sent = 0, i = 0; sent < total; sent += BATCH, i++) {
        char *b = bufs[i % NBUF];
        if (mode != 2)
            for (int o = 0; o < BATCH; o += 1024) { memcpy(b + o, msg, 1024); b[o] = (char)o; }
        if (mode == 1) splice_all(p[1], p[0], c, b, BATCH);
        else write_all(c, b, BATCH);
    }
    pthread_join(th, 0);
    printf("mode %d: %.0f MB/s\n", mode, total / (now() - t0) / 1e6);
    return 0;
}
