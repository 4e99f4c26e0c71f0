/*
 * backend_host.c - pools in host shared memory: a memfd, sealed against
 * shrinking and growing (docs/protocol.md says why memfd), mapped by the
 * daemon and, through the fd socket's MAP, by every worker.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"
#include "backend_memfd.h"

/* memfd sized, preallocated (first-touch faults are slow, C-STACK.md) and
 * sealed so that no worker can shrink it under the others. */
static int open_memfd(const char *model, size_t bytes, status *st)
{
    char name[96];
    snprintf(name, sizeof name, "kvstash-pool-%s", model);
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        status_set(st, ST_INTERNAL, "memfd_create failed: %s", strerror(errno));
        return -1;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        status_set(st, ST_RESOURCE_EXHAUSTED, "cannot size pool to %zu bytes: %s", bytes,
                   strerror(errno));
        goto fail;
    }
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
        status_set(st, ST_RESOURCE_EXHAUSTED, "cannot allocate %zu bytes of pool memory: %s", bytes,
                   strerror(rc));
        goto fail;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        status_set(st, ST_INTERNAL, "cannot seal pool memfd: %s", strerror(errno));
        goto fail;
    }
    return fd;
fail:
    close(fd);
    return -1;
}

status_code memfd_arena_create(const char *model, size_t bytes, backend_arena *a, status *st)
{
    *a = (backend_arena){NULL, bytes, -1, NULL};
    a->fd = open_memfd(model, bytes, st);
    if (a->fd < 0)
        return st->code;
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
    if (map == MAP_FAILED) {
        status_set(st, ST_INTERNAL, "cannot map pool: %s", strerror(errno));
        close(a->fd);
        a->fd = -1;
        return st->code;
    }
    a->base = map;
    return ST_OK;
}

void memfd_arena_destroy(backend_arena *a)
{
    if (a->base != NULL)
        munmap(a->base, a->bytes);
    if (a->fd >= 0)
        close(a->fd);
    *a = (backend_arena){NULL, 0, -1, NULL};
}

status_code memfd_arena_share(const backend_arena *a, backend_share *sh, status *st)
{
    memset(sh, 0, sizeof *sh);
    sh->map.kind = KVSTASH_MAP_MEMFD;
    sh->map.bytes = a->bytes;
    sh->fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (sh->fd < 0)
        return status_set(st, ST_INTERNAL, "dup of the pool memfd failed: %s", strerror(errno));
    return ST_OK;
}

void memfd_describe(backend_info *out)
{
    *out = (backend_info){.device = "none", .device_name = "", .ipc = "memfd"};
}

const backend backend_host = {
    .name = "host",
    .ops = &kv_ops_cpu,
    .start = NULL,
    .arena_create = memfd_arena_create,
    .arena_destroy = memfd_arena_destroy,
    .arena_share = memfd_arena_share,
    .describe = memfd_describe,
};
