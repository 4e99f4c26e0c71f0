#include "fdsock.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"
#include "ring.h"

#define FDSOCK_MSG_MAX 320
#define FDSOCK_MAX_CONNS 4096

typedef struct conn {
    int fd;
    int id;
    int identified;
} conn;

struct fdsock {
    int listen_fd;
    int wake_fd; /* eventfd: written by fdsock_stop */
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    store *store;
    pthread_t thread;
    conn *conns;
    size_t nconns;
    int next_id;
};

static void reply(int fd, const char *text, int pass_fd)
{
    struct iovec iov = {(void *)text, strlen(text)};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    if (pass_fd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        msg.msg_control = ctl.buf;
        msg.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    if (sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        log_debug("fdsock_send_failed", "err=\"%s\"", strerror(errno));
}

/* Answer a request for a memfd: "OK <bytes>" with the fd, or "ERR <why>". */
static void reply_fd(conn *c, status_code rc, const status *s, int fd, size_t bytes)
{
    char msg[FDSOCK_MSG_MAX];
    if (rc != ST_OK) {
        snprintf(msg, sizeof msg, "ERR %s", s->msg);
        reply(c->fd, msg, -1);
        return;
    }
    snprintf(msg, sizeof msg, "OK %zu", bytes);
    reply(c->fd, msg, fd);
    close(fd);
}

static void handle_hello(fdsock *fs, conn *c)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        reply(c->fd, "ERR cannot read peer credentials", -1);
        return;
    }
    /* Only the daemon's own user (or root) may use its memory. */
    if (cred.uid != geteuid() && cred.uid != 0) {
        char msg[FDSOCK_MSG_MAX];
        snprintf(msg, sizeof msg,
                 "ERR permission denied: uid %u may not use this kvstashd (it runs as uid %u)",
                 (unsigned)cred.uid, (unsigned)geteuid());
        reply(c->fd, msg, -1);
        log_warn("peer_rejected", "pid=%d uid=%u", (int)cred.pid, (unsigned)cred.uid);
        return;
    }
    char token[STORE_TOKEN_LEN + 1];
    status s;
    if (store_session_open(fs->store, cred.pid, cred.uid, cred.gid, c->id, token, &s) != ST_OK) {
        char msg[FDSOCK_MSG_MAX];
        snprintf(msg, sizeof msg, "ERR %s", s.msg);
        reply(c->fd, msg, -1);
        return;
    }
    c->identified = 1;
    char msg[8 + STORE_TOKEN_LEN];
    snprintf(msg, sizeof msg, "OK %s", token);
    reply(c->fd, msg, -1);
    log_debug("peer_identified", "conn=%d pid=%d uid=%u", c->id, (int)cred.pid, (unsigned)cred.uid);
}

static void handle_map(fdsock *fs, conn *c, const char *arg)
{
    char *end;
    errno = 0;
    unsigned long long pool_id = strtoull(arg, &end, 10);
    if (errno != 0 || end == arg || *end != '\0') {
        reply(c->fd, "ERR MAP needs a pool id: MAP <pool_id>", -1);
        return;
    }
    int fd = -1;
    size_t bytes = 0;
    status s;
    status_code rc = store_pool_fd(fs->store, c->id, pool_id, &fd, &bytes, &s);
    reply_fd(c, rc, &s, fd, bytes);
}

static void handle_ring(fdsock *fs, conn *c)
{
    int fd = -1;
    size_t bytes = 0;
    status s;
    status_code rc = store_transport_fd(fs->store, c->id, ring_transport_open, &fd, &bytes, &s);
    reply_fd(c, rc, &s, fd, bytes);
}

static void handle_message(fdsock *fs, conn *c, char *text)
{
    if (strcmp(text, "HELLO 1") == 0) {
        if (c->identified)
            reply(c->fd, "ERR already identified on this connection", -1);
        else
            handle_hello(fs, c);
    } else if (strncmp(text, "MAP ", 4) == 0) {
        handle_map(fs, c, text + 4);
    } else if (strcmp(text, "RING") == 0) {
        handle_ring(fs, c);
    } else {
        reply(c->fd, "ERR unknown request (expected 'HELLO 1', 'MAP <pool_id>' or 'RING')", -1);
    }
}

/* Returns 0 while the connection lives, -1 when it closed. */
static int conn_read(fdsock *fs, conn *c)
{
    char buf[FDSOCK_MSG_MAX + 1];
    ssize_t n = recv(c->fd, buf, FDSOCK_MSG_MAX, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    handle_message(fs, c, buf);
    return 0;
}

static void conn_close(fdsock *fs, size_t i)
{
    conn c = fs->conns[i];
    close(c.fd);
    fs->conns[i] = fs->conns[--fs->nconns];
    if (c.identified)
        store_session_conn_closed(fs->store, c.id);
}

static void accept_one(fdsock *fs)
{
    int fd = accept4(fs->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0)
        return;
    if (fs->nconns >= FDSOCK_MAX_CONNS) {
        reply(fd, "ERR too many connections", -1);
        close(fd);
        return;
    }
    fs->conns[fs->nconns++] = (conn){fd, fs->next_id++, 0};
}

static void *fdsock_thread(void *arg)
{
    fdsock *fs = arg;
    struct pollfd *pfd = calloc(FDSOCK_MAX_CONNS + 2, sizeof *pfd);
    if (pfd == NULL)
        return NULL;
    for (;;) {
        pfd[0] = (struct pollfd){fs->wake_fd, POLLIN, 0};
        pfd[1] = (struct pollfd){fs->listen_fd, POLLIN, 0};
        for (size_t i = 0; i < fs->nconns; i++)
            pfd[i + 2] = (struct pollfd){fs->conns[i].fd, POLLIN, 0};
        size_t n = fs->nconns;
        if (poll(pfd, n + 2, -1) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break;
        /* Walk backwards: conn_close moves the last connection into slot i. */
        for (size_t i = n; i-- > 0;)
            if (pfd[i + 2].revents && conn_read(fs, &fs->conns[i]) != 0)
                conn_close(fs, i);
        if (pfd[1].revents & POLLIN)
            accept_one(fs);
    }
    free(pfd);
    return NULL;
}

static status_code bind_listener(fdsock *fs, const char *path, status *s)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return status_set(s, ST_INVALID_ARGUMENT, "socket path too long: %s", path);
    strcpy(addr.sun_path, path);
    strcpy(fs->path, path);
    fs->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fs->listen_fd < 0)
        return status_set(s, ST_INTERNAL, "socket: %s", strerror(errno));
    unlink(path); /* stale from a dead daemon: the pidfile lock proved it dead */
    int rc = bind(fs->listen_fd, (struct sockaddr *)&addr, sizeof addr);
    if (rc != 0 || listen(fs->listen_fd, 128) != 0)
        return status_set(s, ST_UNAVAILABLE, "cannot listen on %s: %s", path, strerror(errno));
    return ST_OK;
}

status_code fdsock_start(const char *path, store *st, fdsock **out, status *s)
{
    *out = NULL;
    fdsock *fs = calloc(1, sizeof *fs);
    if (fs == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    fs->store = st;
    fs->listen_fd = -1;
    fs->wake_fd = eventfd(0, EFD_CLOEXEC);
    fs->conns = calloc(FDSOCK_MAX_CONNS, sizeof *fs->conns);
    if (fs->wake_fd < 0 || fs->conns == NULL) {
        status_set(s, ST_INTERNAL, "cannot set up the fd socket: %s", strerror(errno));
        goto fail;
    }
    if (bind_listener(fs, path, s) != ST_OK)
        goto fail;
    if (pthread_create(&fs->thread, NULL, fdsock_thread, fs) != 0) {
        status_set(s, ST_INTERNAL, "cannot start the fd socket thread");
        goto fail;
    }
    *out = fs;
    return ST_OK;
fail:
    if (fs->listen_fd >= 0)
        close(fs->listen_fd);
    if (fs->wake_fd >= 0)
        close(fs->wake_fd);
    free(fs->conns);
    free(fs);
    return s->code;
}

void fdsock_stop(fdsock *fs)
{
    if (fs == NULL)
        return;
    uint64_t one = 1;
    ssize_t w = write(fs->wake_fd, &one, sizeof one);
    (void)w;
    pthread_join(fs->thread, NULL);
    while (fs->nconns > 0)
        conn_close(fs, fs->nconns - 1);
    close(fs->listen_fd);
    close(fs->wake_fd);
    unlink(fs->path);
    free(fs->conns);
    free(fs);
}
