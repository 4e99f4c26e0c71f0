/* fdsock.c - see fdsock.h. */
#include "fdsock.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvstash.h"
#include "rpc.h"

/* docs/protocol.md says answers are at most 320 bytes; take more so that a
 * longer one reads as itself rather than as a truncation. */
#define FDSOCK_MSG_MAX 1024
#define FDSOCK_MAX_FDS 4 /* we expect one; room to close strays */

int fdsock_connect(const char *socket_path, int *fd, char *err, size_t errlen)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    *fd = -1;
    int n = snprintf(sa.sun_path, sizeof sa.sun_path, "%s.fd", socket_path);
    if (n < 0 || (size_t)n >= sizeof sa.sun_path) {
        snprintf(err, errlen, "socket path too long for a Unix socket: %s.fd", socket_path);
        return KVS_ERR_INVALID;
    }
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) {
        snprintf(err, errlen, "socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
        return KVS_ERR_SYSTEM;
    }
    int ms = rpc_timeout_ms();
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        close(s);
        if (e == EACCES || e == EPERM) {
            snprintf(err, errlen,
                     "cannot connect to kvstashd at %s: %s — its sockets belong to another user",
                     sa.sun_path, strerror(e));
            return KVS_ERR_PERMISSION;
        }
        snprintf(err, errlen, "cannot connect to kvstashd at %s: %s — is kvstashd running?",
                 sa.sun_path, strerror(e));
        return KVS_ERR_UNAVAILABLE;
    }
    *fd = s;
    return KVS_OK;
}

/* Send one request datagram. */
static int send_msg(int fd, const char *msg, char *err, size_t errlen)
{
    ssize_t n = send(fd, msg, strlen(msg), MSG_NOSIGNAL);
    if (n < 0) {
        snprintf(err, errlen, "fd socket: sending \"%s\": %s", msg, strerror(errno));
        return errno == EPIPE || errno == ECONNRESET || errno == EAGAIN ? KVS_ERR_UNAVAILABLE
                                                                        : KVS_ERR_SYSTEM;
    }
    return KVS_OK;
}

/*
 * Receive one answer datagram as a NUL-terminated string in buf[FDSOCK_MSG_MAX
 * + 1]. If `memfd` is not NULL it receives the one attached fd (or -1);
 * every other attached fd is closed.
 */
static int recv_msg(int fd, const char *what, char *buf, int *memfd, char *err, size_t errlen)
{
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(FDSOCK_MAX_FDS * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = FDSOCK_MSG_MAX};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    if (memfd != NULL)
        *memfd = -1;
    ssize_t n;
    do
        n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        int e = errno;
        snprintf(err, errlen, "fd socket: waiting for the answer to %s: %s", what,
                 e == EAGAIN ? "kvstashd did not answer in time" : strerror(e));
        return e == EAGAIN || e == ECONNRESET ? KVS_ERR_UNAVAILABLE : KVS_ERR_SYSTEM;
    }
    /* Keep at most one fd; close any other the kernel handed us. */
    int got = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; i++) {
            int f;
            memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
            if (got < 0 && memfd != NULL)
                got = f;
            else
                close(f);
        }
    }
    if (n == 0) {
        if (got >= 0)
            close(got);
        snprintf(err, errlen, "fd socket: kvstashd closed the connection (answering %s)", what);
        return KVS_ERR_UNAVAILABLE;
    }
    if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        if (got >= 0)
            close(got);
        snprintf(err, errlen, "fd socket: the answer to %s was truncated", what);
        return KVS_ERR_PROTOCOL;
    }
    buf[n] = '\0';
    if (memfd != NULL)
        *memfd = got;
    return KVS_OK;
}

/* An `ERR <reason>` answer, or anything that is not `OK ...`. */
static int bad_answer(const char *what, const char *buf, char *err, size_t errlen)
{
    if (strncmp(buf, "ERR", 3) == 0) {
        const char *reason = buf[3] == ' ' ? buf + 4 : buf + 3;
        snprintf(err, errlen, "kvstashd refused %s: %s", what, reason);
    } else {
        snprintf(err, errlen, "fd socket: unexpected answer to %s: \"%.64s\"", what, buf);
    }
    return KVS_ERR_PROTOCOL;
}

int fdsock_hello(int fd, char *token, char *err, size_t errlen)
{
    char buf[FDSOCK_MSG_MAX + 1];
    int rc = send_msg(fd, "HELLO 1", err, errlen);
    if (rc == KVS_OK)
        rc = recv_msg(fd, "HELLO", buf, NULL, err, errlen);
    if (rc != KVS_OK)
        return rc;
    if (strncmp(buf, "OK ", 3) != 0 || strlen(buf + 3) != FDSOCK_TOKEN_LEN ||
        strspn(buf + 3, "0123456789abcdef") != FDSOCK_TOKEN_LEN)
        return bad_answer("HELLO", buf, err, errlen);
    memcpy(token, buf + 3, FDSOCK_TOKEN_LEN + 1);
    return KVS_OK;
}

/* Send `request` and read its answer (kvstash_map.h) and the fd that came
 * with it, which must be there exactly when the answer's kind has one. */
static int request_map(int fd, const char *request, const char *what, kvstash_map_answer *map,
                       int *memfd, char *err, size_t errlen)
{
    char buf[FDSOCK_MSG_MAX + 1];
    *memfd = -1;
    int rc = send_msg(fd, request, err, errlen);
    int got = -1;
    if (rc == KVS_OK)
        rc = recv_msg(fd, what, buf, &got, err, errlen);
    if (rc != KVS_OK)
        return rc;
    char why[160];
    if (strncmp(buf, "OK ", 3) != 0 || kvstash_map_parse(buf, map, why, sizeof why) != 0) {
        if (got >= 0)
            close(got);
        if (strncmp(buf, "OK ", 3) == 0) {
            snprintf(err, errlen, "fd socket: malformed answer to %s: %s", what, why);
            return KVS_ERR_PROTOCOL;
        }
        return bad_answer(what, buf, err, errlen);
    }
    if (kvstash_map_has_fd(map->kind) != (got >= 0)) {
        if (got >= 0)
            close(got);
        snprintf(err, errlen, "fd socket: kvstashd answered %s %s a file descriptor", what,
                 got >= 0 ? "with an unexpected" : "without");
        return KVS_ERR_PROTOCOL;
    }
    *memfd = got;
    return KVS_OK;
}

int fdsock_map(int fd, uint64_t pool_id, kvstash_map_answer *map, int *memfd, char *err,
               size_t errlen)
{
    char req[64];
    snprintf(req, sizeof req, "MAP %" PRIu64, pool_id);
    return request_map(fd, req, "MAP", map, memfd, err, errlen);
}

int fdsock_ring(int fd, int *memfd, uint64_t *bytes, char *err, size_t errlen)
{
    kvstash_map_answer map;
    int rc = request_map(fd, "RING", "RING", &map, memfd, err, errlen);
    if (rc == KVS_OK && map.kind != KVSTASH_MAP_MEMFD) {
        close(*memfd);
        *memfd = -1;
        snprintf(err, errlen, "fd socket: kvstashd answered RING with a %s arena, not a memfd",
                 kvstash_map_kind_name(map.kind));
        return KVS_ERR_PROTOCOL;
    }
    if (rc == KVS_OK)
        *bytes = map.bytes;
    return rc;
}
