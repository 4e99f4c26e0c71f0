/*
 * test_gpu_ipc.c - kernels/devmem.h across two processes: an arena allocated
 * and exported by this process, imported by a child, for both kinds (legacy
 * cudaIpc handles, VMM POSIX fds passed with SCM_RIGHTS).
 *
 * The child is this program re-executed (posix_spawn of /proc/self/exe with
 * "--child FD"), so it starts with no inherited CUDA state; FD is its end of a
 * SOCK_SEQPACKET socketpair. Parent: allocate, fill with a seeded pattern,
 * export, send. Child: import, check every byte, write its own pattern into
 * the second half, time a copy through its mapping, release, reply. Parent:
 * check both halves, that the arena still works after the child exited, and
 * time the same copy through its own mapping (line `bench op=ipc_import_copy`).
 * The child first runs the error paths an importer can reach (garbage legacy
 * handle, a /dev/null fd, descriptors larger than the allocation); the
 * parent then those of an owner (allocations too large, a bad device).
 *
 * Without a device the checks that need none still run (argument errors, the
 * calls failing cleanly without a driver, the spawn + SCM_RIGHTS transport),
 * then it prints "SKIP: no CUDA device (reason)" and exits 0. Exit 1 on any
 * failure. Plain C + the CUDA runtime (C-STACK.md "The GPU machine").
 */
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "devmem.h"

extern char **environ;

static int g_failures;
static const char *g_who = "parent";

#define FAILF(...)                                                                                 \
    do {                                                                                           \
        fprintf(stderr, "FAIL(%s): %s:%d: ", g_who, __FILE__, __LINE__);                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fputc('\n', stderr);                                                                       \
        g_failures++;                                                                              \
    } while (0)

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            FAILF(__VA_ARGS__);                                                                    \
    } while (0)

/* A CUDA runtime call that must succeed: 1, or 0 after reporting it (the
 * current test part cannot go on). */
static int cuda_ok(cudaError_t e, const char *call, int line)
{
    if (e == cudaSuccess)
        return 1;
    fprintf(stderr, "FAIL(%s): %s:%d: %s: %s\n", g_who, __FILE__, line, call,
            cudaGetErrorString(e));
    (void)cudaGetLastError();
    g_failures++;
    return 0;
}
#define CUDA_OK(call) cuda_ok((call), #call, __LINE__)

/* ---- the pattern: byte i of an arena depends on (seed, i) only, so either
 * side can generate any range of it ---- */

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint8_t pattern_byte(uint64_t seed, size_t i)
{
    return (uint8_t)(mix64(seed ^ ((uint64_t)(i >> 3) * 0x100000001b3ull)) >> ((i & 7) * 8));
}

static void pattern_fill(uint8_t *p, size_t off, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = pattern_byte(seed, off + i);
}

/* Number of bytes of p[0..n) (arena offsets off..) that differ from the
 * pattern; the first one is reported. */
static size_t pattern_check(const uint8_t *p, size_t off, size_t n, uint64_t seed, const char *what)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t want = pattern_byte(seed, off + i);
        if (p[i] != want && bad++ == 0)
            FAILF("%s: byte %zu is 0x%02x, want 0x%02x", what, off + i, p[i], want);
    }
    if (bad)
        FAILF("%s: %zu of %zu bytes differ", what, bad, n);
    return bad;
}

/* ---- the wire: one request, one reply, on a SOCK_SEQPACKET socketpair
 * (both ends are this same binary, so plain structs) ---- */

typedef struct wire_req {
    uint32_t kind; /* kv_devmem_kind; 0: transport check only, no CUDA */
    uint32_t device;
    uint64_t bytes;
    uint64_t seed_parent, seed_child;
    uint8_t legacy_handle[KV_DEVMEM_IPC_HANDLE_BYTES];
} wire_req;

typedef struct wire_rep {
    int32_t failures;
    int32_t got_fd;
    double copy_us; /* the child's timed copy, 0 if none */
} wire_rep;

/* Room for one fd of ancillary data. */
typedef union fd_control {
    struct cmsghdr h;
    char b[CMSG_SPACE(sizeof(int))];
} fd_control;

static void msg_init(struct msghdr *m, struct iovec *iov, fd_control *c)
{
    memset(m, 0, sizeof *m);
    memset(c, 0, sizeof *c);
    m->msg_iov = iov;
    m->msg_iovlen = 1;
    m->msg_control = c->b;
    m->msg_controllen = sizeof c->b;
}

/* Send buf as one message, with fd attached (SCM_RIGHTS) when fd >= 0. */
static int send_msg(int s, const void *buf, size_t n, int fd)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = n};
    struct msghdr m;
    fd_control c;
    msg_init(&m, &iov, &c);
    if (fd >= 0) {
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(h), &fd, sizeof fd);
    } else {
        m.msg_control = NULL;
        m.msg_controllen = 0;
    }
    ssize_t r = sendmsg(s, &m, MSG_NOSIGNAL);
    return r == (ssize_t)n ? 0 : -1;
}

/* Receive one message of exactly n bytes; *fd gets an attached fd or -1. */
static int recv_msg(int s, void *buf, size_t n, int *fd)
{
    struct iovec iov = {.iov_base = buf, .iov_len = n};
    struct msghdr m;
    fd_control c;
    msg_init(&m, &iov, &c);
    *fd = -1;
    ssize_t r = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&m); r > 0 && h; h = CMSG_NXTHDR(&m, h))
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS)
            memcpy(fd, CMSG_DATA(h), sizeof *fd);
    if (r != (ssize_t)n || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        if (*fd >= 0)
            close(*fd);
        *fd = -1;
        return -1;
    }
    return 0;
}

/* ---- timing ---- */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median of 20 device-to-device copies of n bytes, in microseconds (0 on a
 * CUDA error, which is reported). */
static double time_copy_us(void *dst, const void *src, size_t n)
{
    enum { REPS = 20 };
    float ms[REPS];
    cudaEvent_t e0, e1;
    if (!CUDA_OK(cudaEventCreate(&e0)))
        return 0;
    if (!CUDA_OK(cudaEventCreate(&e1))) {
        cudaEventDestroy(e0);
        return 0;
    }
    double us = 0;
    int ok = CUDA_OK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice)); /* warm up */
    for (int r = 0; ok && r < REPS; r++) {
        ok = CUDA_OK(cudaEventRecord(e0, 0)) &&
             CUDA_OK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, 0)) &&
             CUDA_OK(cudaEventRecord(e1, 0)) && CUDA_OK(cudaEventSynchronize(e1)) &&
             CUDA_OK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    if (ok) {
        qsort(ms, REPS, sizeof ms[0], cmp_float);
        us = (double)ms[REPS / 2] * 1000.0;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return us;
}

/* Time copying the first half of the arena into a scratch buffer of this
 * process: the read goes through this process's mapping. */
static double time_half_copy(const kv_devmem_arena *a)
{
    size_t half = a->bytes / 2;
    void *scratch = NULL;
    if (!CUDA_OK(cudaMalloc(&scratch, half)))
        return 0;
    double us = time_copy_us(scratch, a->ptr, half);
    CUDA_OK(cudaFree(scratch));
    return us;
}

/* ---- the child ---- */

/* An import that must fail with `code` and a message containing `needle`. */
static void expect_import_fails(const kv_devmem_desc *d, int device, int code, const char *needle,
                                const char *what)
{
    kv_devmem_arena a;
    char err[512] = "";
    int rc = kv_devmem_import(d, device, &a, err, sizeof err);
    if (rc == 0) {
        FAILF("%s: import succeeded", what);
        kv_devmem_release(&a, NULL, 0);
        return;
    }
    CHECK(rc == code, "%s: code %d (%s), want %d; message: %s", what, rc, kv_devmem_strerror(rc),
          code, err);
    CHECK(strstr(err, needle) != NULL, "%s: message \"%s\" does not name \"%s\"", what, err,
          needle);
    CHECK(a.kind == KV_DEVMEM_NONE && a.ptr == NULL, "%s: arena not zeroed on failure", what);
    printf("ok: %s -> %s: %s\n", what, kv_devmem_strerror(rc), err);
}

/* The error paths an importer can test, run before the real import (so
 * they also show that a failed import leaves the process able to import).
 * `fd` is the VMM fd received (or -1); it stays open. */
static void child_error_paths(const wire_req *q, int fd)
{
    kv_devmem_desc d;
    memset(&d, 0, sizeof d);
    d.fd = -1;
    d.bytes = q->bytes;
    if (q->kind == KV_DEVMEM_LEGACY) {
        d.kind = KV_DEVMEM_LEGACY;
        for (size_t i = 0; i < sizeof d.legacy_handle; i++)
            d.legacy_handle[i] = pattern_byte(0xbad, i);
        expect_import_fails(&d, (int)q->device, KV_DEVMEM_ECUDA, "cudaIpcOpenMemHandle",
                            "legacy import of a garbage handle");
        /* The real handle, but claiming more bytes than it holds. */
        memcpy(d.legacy_handle, q->legacy_handle, sizeof d.legacy_handle);
        d.bytes = q->bytes + 1;
        expect_import_fails(&d, (int)q->device, KV_DEVMEM_EINVAL, "holds",
                            "legacy import claiming one byte too many");
        return;
    }
    d.kind = KV_DEVMEM_VMM;
    /* A /dev/null fd: open, but no CUDA allocation behind it. */
    d.fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    CHECK(d.fd >= 0, "open /dev/null: %s", strerror(errno));
    if (d.fd >= 0) {
        expect_import_fails(&d, (int)q->device, KV_DEVMEM_ECUDA, "cuMemImportFromShareableHandle",
                            "vmm import of a /dev/null fd");
        close(d.fd);
    }
    if (fd >= 0) {
        /* The real allocation, but one granule more than it holds: cuMemMap
         * refuses to map past its end. */
        kv_devmem_arena probe;
        d.fd = fd;
        char err[512] = "";
        if (kv_devmem_import(&d, (int)q->device, &probe, err, sizeof err) == 0) {
            d.bytes = q->bytes + probe.granularity;
            kv_devmem_release(&probe, NULL, 0);
            expect_import_fails(&d, (int)q->device, KV_DEVMEM_ECUDA, "cuMemMap",
                                "vmm import claiming one granule too many");
        } else {
            FAILF("vmm re-import of the real fd: %s", err);
        }
    }
}

/* Import, check, write, time, release. Returns the copy time (0 if none). */
static double child_import(const wire_req *q, int fd)
{
    kv_devmem_desc d;
    memset(&d, 0, sizeof d);
    d.kind = (kv_devmem_kind)q->kind;
    d.bytes = (size_t)q->bytes;
    d.fd = fd;
    memcpy(d.legacy_handle, q->legacy_handle, sizeof d.legacy_handle);

    kv_devmem_arena a;
    char err[512] = "";
    int rc = kv_devmem_import(&d, (int)q->device, &a, err, sizeof err);
    if (d.kind == KV_DEVMEM_VMM)
        close(fd); /* devmem.h: the import holds its own reference; this was
                    * the process's only copy, so the checks below show it */
    if (rc) {
        FAILF("import: %s (%s)", kv_devmem_strerror(rc), err);
        return 0;
    }
    CHECK(a.ptr && a.bytes == d.bytes && a.imported == 1 && a.kind == d.kind,
          "imported arena: ptr %p bytes %zu imported %d kind %d", a.ptr, a.bytes, a.imported,
          (int)a.kind);
    size_t n = a.bytes, half = n / 2;
    uint8_t *h = malloc(n);
    double us = 0;
    if (!h) {
        FAILF("out of host memory (%zu bytes)", n);
    } else if (CUDA_OK(cudaMemcpy(h, a.ptr, n, cudaMemcpyDeviceToHost))) {
        if (pattern_check(h, 0, n, q->seed_parent, "child reads the parent's pattern") == 0)
            printf("ok: child read all %zu bytes of the parent's %s arena\n", n,
                   kv_devmem_kind_name(a.kind));
        pattern_fill(h, half, n - half, q->seed_child);
        /* cudaMemcpy from pageable memory may return before the DMA ends:
         * synchronise before telling the parent. */
        if (CUDA_OK(cudaMemcpy((uint8_t *)a.ptr + half, h, n - half, cudaMemcpyHostToDevice)) &&
            CUDA_OK(cudaDeviceSynchronize()))
            us = time_half_copy(&a);
    }
    free(h);
    rc = kv_devmem_release(&a, err, sizeof err);
    CHECK(rc == 0, "release of the import: %s", err);
    CHECK(kv_devmem_release(&a, err, sizeof err) == 0, "second release: %s", err);
    return us;
}

static int child_main(int sock)
{
    wire_req q;
    int fd = -1;
    if (recv_msg(sock, &q, sizeof q, &fd) != 0) {
        FAILF("no request from the parent (%s)", strerror(errno));
        return 1;
    }
    static char who[32];
    snprintf(who, sizeof who, "child %s", kv_devmem_kind_name((kv_devmem_kind)q.kind));
    g_who = q.kind ? who : "child transport";
    wire_rep p = {.got_fd = fd >= 0};
    if (q.kind == KV_DEVMEM_NONE) {
        /* Transport check: the fd arrived and is open; no CUDA call. */
        struct stat st;
        CHECK(fd >= 0 && fstat(fd, &st) == 0, "no open fd received");
        if (fd >= 0)
            close(fd);
    } else {
        child_error_paths(&q, fd);
        p.copy_us = child_import(&q, fd); /* closes fd */
    }
    p.failures = g_failures;
    if (send_msg(sock, &p, sizeof p, -1) != 0) {
        FAILF("reply: %s", strerror(errno));
        return 1;
    }
    close(sock);
    return g_failures ? 1 : 0;
}

/* ---- the parent ---- */

/* Start this program as "--child FD", send it q (and fd), wait for its reply
 * and its exit. Returns 0 when both came and the child exited 0. */
static int run_child(const char *argv0, const wire_req *q, int fd, wire_rep *p)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
        FAILF("socketpair: %s", strerror(errno));
        return -1;
    }
    /* Only the child's end crosses exec. */
    int rc = -1;
    pid_t pid = -1;
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", sv[1]);
    char *args[] = {(char *)argv0, "--child", fdarg, NULL};
    struct timeval tv = {.tv_sec = 300};
    if (fcntl(sv[1], F_SETFD, 0) != 0 ||
        setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0) {
        FAILF("socket setup: %s", strerror(errno));
        goto out;
    }
    int e = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ);
    if (e != 0) {
        FAILF("posix_spawn /proc/self/exe: %s", strerror(e));
        pid = -1;
        goto out;
    }
    close(sv[1]);
    sv[1] = -1;
    if (send_msg(sv[0], q, sizeof *q, fd) != 0) {
        FAILF("send to the child: %s", strerror(errno));
        goto out;
    }
    int none;
    if (recv_msg(sv[0], p, sizeof *p, &none) != 0) {
        FAILF("no reply from the child: %s", strerror(errno));
        goto out;
    }
    rc = 0;
out:
    close(sv[0]);
    if (sv[1] >= 0)
        close(sv[1]);
    if (pid > 0) {
        int st = 0;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            FAILF("child exited with status 0x%x", st);
            rc = -1;
        }
    }
    return rc;
}

static void bench_line(kv_devmem_kind kind, size_t n, double import_us, double export_us)
{
    if (import_us <= 0 || export_us <= 0)
        return;
    /* Bytes read plus written, as the other GPU benchmarks count. */
    double ig = 2.0 * (double)n / (import_us * 1e3), eg = 2.0 * (double)n / (export_us * 1e3);
    printf("bench op=ipc_import_copy kind=%s bytes=%zu import_us=%.1f export_us=%.1f "
           "import_rw_GBps=%.1f export_rw_GBps=%.1f ratio=%.3f\n",
           kv_devmem_kind_name(kind), n, import_us, export_us, ig, eg, ig / eg);
}

/* One kind end to end. */
static void run_kind(const char *argv0, kv_devmem_kind kind, size_t request, uint64_t seed)
{
    g_who = kind == KV_DEVMEM_LEGACY ? "parent legacy" : "parent vmm";
    kv_devmem_arena a;
    char err[512] = "";
    int rc = kv_devmem_alloc(kind, 0, request, &a, err, sizeof err);
    if (rc) {
        FAILF("alloc %zu bytes: %s (%s)", request, kv_devmem_strerror(rc), err);
        return;
    }
    if (kind == KV_DEVMEM_LEGACY)
        CHECK(a.bytes == request, "legacy arena holds %zu bytes, asked %zu", a.bytes, request);
    else
        CHECK(a.granularity > 0 && a.bytes >= request && a.bytes % a.granularity == 0 &&
                  a.bytes - request < a.granularity,
              "vmm arena: %zu bytes for %zu asked, granularity %zu", a.bytes, request,
              a.granularity);
    printf("ok: %s arena of %zu bytes (asked %zu, granularity %zu) at %p\n",
           kv_devmem_kind_name(kind), a.bytes, request, a.granularity, a.ptr);

    size_t n = a.bytes, half = n / 2;
    uint8_t *h = malloc(n);
    kv_devmem_desc d = {.fd = -1};
    wire_req q;
    wire_rep p;
    memset(&q, 0, sizeof q);
    memset(&p, 0, sizeof p);
    if (!h) {
        FAILF("out of host memory (%zu bytes)", n);
        goto out;
    }
    pattern_fill(h, 0, n, seed);
    if (!CUDA_OK(cudaMemcpy(a.ptr, h, n, cudaMemcpyHostToDevice)) ||
        !CUDA_OK(cudaDeviceSynchronize()))
        goto out;
    rc = kv_devmem_export(&a, &d, err, sizeof err);
    if (rc) {
        FAILF("export: %s (%s)", kv_devmem_strerror(rc), err);
        goto out;
    }
    CHECK(d.kind == kind && d.bytes == n, "descriptor: kind %d bytes %zu", (int)d.kind, d.bytes);
    CHECK((kind == KV_DEVMEM_VMM) == (d.fd >= 0), "descriptor fd %d for kind %s", d.fd,
          kv_devmem_kind_name(kind));

    q.kind = (uint32_t)kind;
    q.device = 0;
    q.bytes = n;
    q.seed_parent = seed;
    q.seed_child = seed ^ 0xc0ffee;
    memcpy(q.legacy_handle, d.legacy_handle, sizeof q.legacy_handle);
    rc = run_child(argv0, &q, d.fd, &p);
    if (d.fd >= 0)
        close(d.fd); /* ours to close; the child had its own copy */
    if (rc != 0 || p.failures != 0) {
        FAILF("child: %d failure(s)", p.failures);
        goto out;
    }
    CHECK((kind == KV_DEVMEM_VMM) == (p.got_fd != 0), "child got_fd %d", p.got_fd);

    /* The child has exited and released its import: our arena must hold the
     * child's writes and our own, and still work. */
    if (!CUDA_OK(cudaMemcpy(h, a.ptr, n, cudaMemcpyDeviceToHost)))
        goto out;
    size_t bad = pattern_check(h, 0, half, seed, "parent's first half after the child") +
                 pattern_check(h + half, half, n - half, q.seed_child, "child's second half");
    if (bad == 0)
        printf("ok: parent reads its first half and the child's second half (%s)\n",
               kv_devmem_kind_name(kind));
    if (CUDA_OK(cudaMemset(a.ptr, 0xa5, n)) &&
        CUDA_OK(cudaMemcpy(h, a.ptr, n, cudaMemcpyDeviceToHost))) {
        size_t i = 0;
        while (i < n && h[i] == 0xa5)
            i++;
        CHECK(i == n, "arena after the child exited: byte %zu is 0x%02x after memset", i, h[i]);
        if (i == n)
            printf("ok: %s arena still readable and writable after the child exited\n",
                   kv_devmem_kind_name(kind));
    }
    bench_line(kind, half, p.copy_us, time_half_copy(&a));
out:
    free(h);
    rc = kv_devmem_release(&a, err, sizeof err);
    CHECK(rc == 0, "release: %s", err);
    CHECK(a.kind == KV_DEVMEM_NONE && a.ptr == NULL, "release left the arena set");
    CHECK(kv_devmem_release(&a, err, sizeof err) == 0, "second release: %s", err);
}

/* Errors an owner can provoke on a device. */
static void device_error_paths(void)
{
    g_who = "parent errors";
    kv_devmem_arena a;
    char err[512] = "";
    const size_t huge = (size_t)1 << 50; /* 1 PiB */
    int rc = kv_devmem_alloc(KV_DEVMEM_LEGACY, 0, huge, &a, err, sizeof err);
    CHECK(rc == KV_DEVMEM_ECUDA && strstr(err, "cudaMalloc"), "legacy 1 PiB: %d (%s)", rc, err);
    if (rc == KV_DEVMEM_ECUDA && strstr(err, "cudaMalloc"))
        printf("ok: legacy 1 PiB -> %s\n", err);
    kv_devmem_release(&a, NULL, 0); /* in case it succeeded */
    rc = kv_devmem_alloc(KV_DEVMEM_VMM, 0, huge, &a, err, sizeof err);
    CHECK(rc == KV_DEVMEM_ECUDA && strstr(err, "cuMem"), "vmm 1 PiB: %d (%s)", rc, err);
    if (rc == KV_DEVMEM_ECUDA && strstr(err, "cuMem"))
        printf("ok: vmm 1 PiB -> %s\n", err);
    kv_devmem_release(&a, NULL, 0);
    rc = kv_devmem_alloc(KV_DEVMEM_LEGACY, 1 << 20, 4096, &a, err, sizeof err);
    CHECK(rc == KV_DEVMEM_ECUDA && strstr(err, "cudaSetDevice"), "device 2^20: %d (%s)", rc, err);
    if (rc == KV_DEVMEM_ECUDA && strstr(err, "cudaSetDevice"))
        printf("ok: device 2^20 -> %s\n", err);
    kv_devmem_release(&a, NULL, 0);
    /* A device that works afterwards: none of the above was sticky. */
    rc = kv_devmem_alloc(KV_DEVMEM_LEGACY, 0, 4096, &a, err, sizeof err);
    CHECK(rc == 0, "a small arena after the errors: %s", err);
    kv_devmem_release(&a, NULL, 0);
}

/* ---- checks that need no device ---- */

/* Argument errors: caught before any CUDA call. */
static void argument_checks(void)
{
    g_who = "arguments";
    kv_devmem_arena a;
    kv_devmem_desc d;
    char err[256];
    memset(&a, 0x5a, sizeof a); /* must be zeroed on failure */
    CHECK(kv_devmem_alloc(KV_DEVMEM_LEGACY, 0, 0, &a, err, sizeof err) == KV_DEVMEM_EINVAL &&
              strstr(err, "zero bytes") && a.kind == KV_DEVMEM_NONE,
          "alloc of 0 bytes: %s", err);
    CHECK(kv_devmem_alloc((kv_devmem_kind)7, 0, 4096, &a, err, sizeof err) == KV_DEVMEM_EINVAL &&
              strstr(err, "unknown kind"),
          "alloc of kind 7: %s", err);
    CHECK(kv_devmem_alloc(KV_DEVMEM_VMM, -1, 4096, &a, err, sizeof err) == KV_DEVMEM_EINVAL,
          "alloc on device -1: %s", err);
    CHECK(kv_devmem_alloc(KV_DEVMEM_VMM, 0, 0, &a, NULL, 0) == KV_DEVMEM_EINVAL,
          "alloc without an error buffer");

    memset(&d, 0, sizeof d);
    d.kind = KV_DEVMEM_VMM;
    d.bytes = 1 << 21;
    d.fd = -1;
    CHECK(kv_devmem_import(&d, 0, &a, err, sizeof err) == KV_DEVMEM_EINVAL &&
              strstr(err, "not open"),
          "vmm import of fd -1: %s", err);
    /* A closed fd, on a number nothing else will take meanwhile. */
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int high = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 900) : -1;
    CHECK(high >= 0, "dup: %s", strerror(errno));
    if (fd >= 0)
        close(fd);
    if (high >= 0) {
        close(high);
        d.fd = high;
        CHECK(kv_devmem_import(&d, 0, &a, err, sizeof err) == KV_DEVMEM_EINVAL &&
                  strstr(err, "not open"),
              "vmm import of a closed fd: %s", err);
        printf("ok: vmm import of a closed fd -> %s\n", err);
    }
    d.kind = KV_DEVMEM_LEGACY;
    d.bytes = 0;
    CHECK(kv_devmem_import(&d, 0, &a, err, sizeof err) == KV_DEVMEM_EINVAL,
          "legacy import of 0 bytes: %s", err);
    d.kind = KV_DEVMEM_NONE;
    d.bytes = 4096;
    CHECK(kv_devmem_import(&d, 0, &a, err, sizeof err) == KV_DEVMEM_EINVAL,
          "import of kind none: %s", err);

    memset(&a, 0, sizeof a);
    CHECK(kv_devmem_export(&a, &d, err, sizeof err) == KV_DEVMEM_EINVAL && d.fd == -1,
          "export of an empty arena: %s", err);
    a.kind = KV_DEVMEM_VMM;
    a.ptr = &a;
    a.imported = 1;
    CHECK(kv_devmem_export(&a, &d, err, sizeof err) == KV_DEVMEM_EINVAL && strstr(err, "import"),
          "export of an import: %s", err);
    memset(&a, 0, sizeof a);
    CHECK(kv_devmem_release(&a, err, sizeof err) == 0, "release of a zeroed arena");
    CHECK(kv_devmem_release(NULL, err, sizeof err) == 0, "release of NULL");
    CHECK(strcmp(kv_devmem_strerror(KV_DEVMEM_ECUDA), "CUDA call failed") == 0, "strerror");
}

/* Without a device: the calls that reach CUDA fail cleanly with a message. */
static void no_device_checks(void)
{
    g_who = "no device";
    kv_devmem_arena a;
    kv_devmem_desc d;
    char err[256] = "";
    for (int k = KV_DEVMEM_LEGACY; k <= KV_DEVMEM_VMM; k++) {
        int rc = kv_devmem_alloc((kv_devmem_kind)k, 0, 1 << 20, &a, err, sizeof err);
        int good = rc == KV_DEVMEM_ECUDA && err[0] && a.ptr == NULL;
        CHECK(good, "%s alloc without a device: %d %s", kv_devmem_kind_name((kv_devmem_kind)k), rc,
              err);
        if (good)
            printf("ok: %s alloc without a device -> %s\n", kv_devmem_kind_name((kv_devmem_kind)k),
                   err);
        kv_devmem_release(&a, NULL, 0);
    }
    memset(&d, 0, sizeof d);
    d.kind = KV_DEVMEM_LEGACY;
    d.bytes = 1 << 20;
    d.fd = -1;
    int rc = kv_devmem_import(&d, 0, &a, err, sizeof err);
    CHECK(rc == KV_DEVMEM_ECUDA && err[0], "legacy import without a device: %d %s", rc, err);
}

/* The spawn + SCM_RIGHTS path the GPU part relies on, with a pipe for fd. */
static void transport_check(const char *argv0)
{
    g_who = "transport";
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0) {
        FAILF("pipe: %s", strerror(errno));
        return;
    }
    wire_req q;
    wire_rep p;
    memset(&q, 0, sizeof q);
    memset(&p, 0, sizeof p);
    int rc = run_child(argv0, &q, pfd[0], &p);
    CHECK(rc == 0 && p.failures == 0 && p.got_fd == 1, "transport: rc %d failures %d got_fd %d", rc,
          p.failures, p.got_fd);
    if (rc == 0 && p.failures == 0 && p.got_fd == 1)
        printf("ok: child spawned, fd passed with SCM_RIGHTS, reply received\n");
    close(pfd[0]);
    close(pfd[1]);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && strcmp(argv[1], "--child") == 0)
        return child_main(atoi(argv[2]));
    argument_checks();
    transport_check(argv[0]);
    char why[256];
    if (!kv_devmem_probe(why, sizeof why)) {
        no_device_checks();
        if (g_failures) {
            fprintf(stderr, "%d failure(s)\n", g_failures);
            return 1;
        }
        printf("SKIP: no CUDA device (%s)\n", why);
        return 0;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        printf("device 0: %s (%s)\n", prop.name, why);

    run_kind(argv[0], KV_DEVMEM_LEGACY, (size_t)64 << 20, 0x1e9ac7);
    /* Not a multiple of any granularity: the arena rounds up. */
    run_kind(argv[0], KV_DEVMEM_VMM, ((size_t)64 << 20) - 12345, 0x7d3e);
    device_error_paths();
    if (g_failures) {
        fprintf(stderr, "%d failure(s)\n", g_failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
