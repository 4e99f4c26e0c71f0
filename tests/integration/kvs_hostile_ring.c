/*
 * kvs_hostile_ring.c - the worker sides of test_hostile_ring.py (issue 12,
 * problem 1): one hostile, two honest.
 *
 *   kvs_hostile_ring scribble BYTES FD...
 *       Map the ring memfds FD... (inherited from the test, which asked
 *       kvstashd for them over the fd socket) and, until killed, rewrite their
 *       headers as a hostile worker would: `closing` back to 0 in a tight
 *       loop, garbage in the request, the response, the magic and the
 *       waiting flags. It leaves req_seq alone: a daemon thread that sleeps
 *       on it checks `closing` only when woken. Several rings and several
 *       scribblers make the race of the unfixed daemon (does its thread look
 *       at `closing` before the scribbler resets it?) nearly always go the
 *       hostile way. Prints "SCRIBBLING" once it has started.
 *   kvs_hostile_ring honest SOCKET
 *       Attach (HELLO, Attach, lease, pool, ring), create a "full" sequence,
 *       append 4 tokens and end a step through the ring, release, detach.
 *       Prints "HONEST ok ms=<total>" and exits 0, or the error and exits 2.
 *   kvs_hostile_ring blocked SOCKET
 *       Attach and create a sequence, print "READY", wait for a line on
 *       stdin, then make one ring call (an append) and print
 *       "RESULT rc=<kvs_err> ms=<how long the call took>". The test stops
 *       kvstashd before that line and kills it while the call waits.
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kvstash.h"
#include "kvstash_ring.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#define MAX_RINGS 16

static int scribble(size_t bytes, int nfds, char **fds)
{
    ring_header *h[MAX_RINGS];
    for (int r = 0; r < nfds; r++) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, atoi(fds[r]), 0);
        if (p == MAP_FAILED) {
            perror("scribble: mmap");
            return 2;
        }
        h[r] = p;
    }
    printf("SCRIBBLING\n");
    fflush(stdout);
    uint64_t x = 0x9e3779b97f4a7c15ull; /* xorshift: fixed seed */
    for (int r = 0;; r = (r + 1) % nfds) {
        atomic_store((_Atomic uint32_t *)&h[r]->closing, 0);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        /* Everything in the header but the counters: magic and size, the
         * waiting flags, and 8 bytes somewhere in the request or response. */
        h[r]->magic = x;
        h[r]->bytes = x >> 3;
        h[r]->daemon_waiting = (uint32_t)x & 1;
        h[r]->worker_waiting = (uint32_t)(x >> 1) & 1;
        size_t span = sizeof *h[r] - offsetof(ring_header, req) - sizeof x;
        memcpy((uint8_t *)h[r] + offsetof(ring_header, req) + (x >> 16) % span, &x, sizeof x);
    }
}

static int api(kvs_session *s, int rc, const char *what)
{
    if (rc != KVS_OK)
        fprintf(stderr, "%s: %s: %s\n", what, kvs_strerror(rc), s ? kvs_session_error(s) : "");
    return rc;
}

static kvs_session *attach(const char *sock, uint64_t *seq)
{
    kvs_geometry g = {2, 4, 2, 8, 16, KVS_FP32, 0};
    kvs_session *s;
    char err[512];
    int rc = kvs_session_attach(sock, "wire", &g, "hostile-ring", &s, err, sizeof err);
    if (rc != KVS_OK) {
        fprintf(stderr, "attach: %s: %s\n", kvs_strerror(rc), err);
        return NULL;
    }
    if (api(s, kvs_seq_create(s, "full", NULL, 0, "ring", seq), "create") != KVS_OK) {
        kvs_session_detach(s);
        return NULL;
    }
    return s;
}

static int honest(const char *sock)
{
    double t0 = now_ms();
    uint64_t seq;
    kvs_session *s = attach(sock, &seq);
    if (s == NULL)
        return 2;
    kvs_table t;
    int rc = api(s, kvs_seq_append(s, seq, 4, &t), "append");
    if (rc == KVS_OK) {
        kvs_table_free(&t);
        kvs_step step = {.confidence = -1};
        rc = api(s, kvs_seq_step(s, seq, &step, NULL), "step");
    }
    if (rc == KVS_OK)
        rc = api(s, kvs_seq_release(s, seq), "release");
    kvs_session_detach(s);
    if (rc != KVS_OK)
        return 2;
    printf("HONEST ok ms=%.1f\n", now_ms() - t0);
    return 0;
}

static int blocked(const char *sock)
{
    uint64_t seq;
    kvs_session *s = attach(sock, &seq);
    if (s == NULL)
        return 2;
    printf("READY\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL)
        return 2;
    kvs_table t;
    double t0 = now_ms();
    int rc = kvs_seq_append(s, seq, 1, &t);
    double ms = now_ms() - t0;
    if (rc == KVS_OK)
        kvs_table_free(&t);
    printf("RESULT rc=%d ms=%.1f\n", rc, ms);
    fflush(stdout);
    kvs_session_detach(s); /* fails, the daemon being gone, but frees the session */
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 4 && argc - 3 <= MAX_RINGS && strcmp(argv[1], "scribble") == 0)
        return scribble((size_t)strtoull(argv[2], NULL, 10), argc - 3, argv + 3);
    if (argc == 3 && strcmp(argv[1], "honest") == 0)
        return honest(argv[2]);
    if (argc == 3 && strcmp(argv[1], "blocked") == 0)
        return blocked(argv[2]);
    fprintf(stderr,
            "usage: kvs_hostile_ring scribble BYTES FD... | honest SOCKET | blocked SOCKET\n");
    return 3;
}
