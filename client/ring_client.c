#include "ring_client.h"

#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvstash.h"
#include "rpc.h"

/* A sleep on the answer's futex lasts at most this long before the call
 * checks its deadline and whether kvstashd still lives. */
#define RING_CLIENT_SLICE_NS (50 * 1000 * 1000)

int ring_client_open(ring_client *rc, int memfd, uint64_t bytes, int peer_fd, char *err,
                     size_t errlen)
{
    memset(rc, 0, sizeof *rc);
    rc->peer_fd = peer_fd;
    if (bytes < RING_DATA_OFFSET + 4096) {
        close(memfd);
        snprintf(err, errlen, "ring: kvstashd announced a ring of %llu bytes, too small",
                 (unsigned long long)bytes);
        return KVS_ERR_PROTOCOL;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
    close(memfd);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "ring: mmap: %s", strerror(errno));
        return KVS_ERR_SYSTEM;
    }
    rc->hdr = p;
    if (rc->hdr->magic != RING_MAGIC || rc->hdr->bytes != bytes) {
        munmap(p, bytes);
        rc->hdr = NULL;
        snprintf(err, errlen, "ring: not a kvstash ring (bad magic or size)");
        return KVS_ERR_PROTOCOL;
    }
    rc->bytes = bytes;
    rc->data = (uint8_t *)p + RING_DATA_OFFSET;
    rc->data_bytes = bytes - RING_DATA_OFFSET;
    return KVS_OK;
}

void ring_client_close(ring_client *rc)
{
    if (rc->hdr != NULL)
        munmap(rc->hdr, rc->bytes);
    memset(rc, 0, sizeof *rc);
    rc->peer_fd = -1;
}

/* 1 when the daemon's end of the session's fd-socket connection is gone
 * (kvstashd died or closed the session): no answer can come. Asked only
 * after a sleep slice, so the fast path pays no system call for it. */
static int peer_gone(const ring_client *rc)
{
    if (rc->peer_fd < 0)
        return 0;
    struct pollfd p = {rc->peer_fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int ring_client_call(ring_client *rc, ring_response *resp)
{
    return ring_client_call_spin(rc, RING_CLIENT_SPIN, resp);
}

int ring_client_call_spin(ring_client *rc, uint32_t spins, ring_response *resp)
{
    ring_header *h = rc->hdr;
    _Atomic uint32_t *req = (_Atomic uint32_t *)&h->req_seq;
    _Atomic uint32_t *ans = (_Atomic uint32_t *)&h->resp_seq;
    _Atomic uint32_t *closing = (_Atomic uint32_t *)&h->closing;
    _Atomic uint32_t *daemon_waiting = (_Atomic uint32_t *)&h->daemon_waiting;
    _Atomic uint32_t *worker_waiting = (_Atomic uint32_t *)&h->worker_waiting;
    if (atomic_load(closing))
        return KVS_ERR_UNAVAILABLE;
    uint32_t want = atomic_load(req) + 1;
    atomic_store(req, want);
    if (atomic_load(daemon_waiting)) {
        atomic_store(daemon_waiting, 0);
        syscall(SYS_futex, (uint32_t *)req, FUTEX_WAKE, 1, NULL, NULL, 0);
    }
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    long limit_ms = rpc_timeout_ms();
    for (uint32_t i = 0; atomic_load(ans) != want; i++) {
        if (atomic_load(closing))
            return KVS_ERR_UNAVAILABLE;
        if (i < spins) {
            /* As the daemon: let a thread sharing our CPU run now and then. */
            if (i % 32 == 31)
                sched_yield();
            else
                cpu_relax();
            continue;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        long waited = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited >= limit_ms)
            return KVS_ERR_UNAVAILABLE; /* a stopped or hung daemon, as gRPC's deadline */
        /* Sleep in slices, so the deadline holds even without a wake-up,
         * and a dead daemon is noticed within a slice, not at the deadline. */
        struct timespec slice = {0, RING_CLIENT_SLICE_NS};
        atomic_store(worker_waiting, 1);
        uint32_t seen = atomic_load(ans);
        if (seen != want && !atomic_load(closing))
            syscall(SYS_futex, (uint32_t *)ans, FUTEX_WAIT, seen, &slice, NULL, 0);
        atomic_store(worker_waiting, 0);
        if (atomic_load(ans) != want && peer_gone(rc))
            return KVS_ERR_UNAVAILABLE;
    }
    if (atomic_load(closing)) /* closing also bumps resp_seq: no answer came */
        return KVS_ERR_UNAVAILABLE;
    memcpy(resp, (const void *)&h->resp, sizeof *resp);
    return KVS_OK;
}
