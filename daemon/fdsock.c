#include "fdsock.h"

#include <errno.h>
#include <fcntl.h>
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

#include "kvstash_map.h"
#include "kvstash_ring.h"
#include "log.h"
#include "metrics.h"
#include "ring.h"

#define FDSOCK_MSG_MAX 320
/* Attached sessions (--max-sessions, at most 4096) plus pending connections
 * (--max-pending, at most 4096): the table never fills before those caps. */
#define FDSOCK_MAX_CONNS 8192
#define FDSOCK_BACKOFF_MS 100 /* listener unpolled this long when no fd is left */

typedef struct conn {
    int fd;
    int id;
    int identified;
    uint64_t idle_since; /* store_now_ms() since when it has no attached session; 0 = it has */
} conn;

struct fdsock {
    int listen_fd;
    int wake_fd;  /* eventfd: written by fdsock_stop */
    int spare_fd; /* /dev/null, given up to accept-and-close when no fd is left; -1 = none */
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    store *store;
    fdsock_config cfg;
    pthread_t thread;
    conn *conns;
    size_t nconns;
    int next_id;
    int *attached;                /* [FDSOCK_MAX_CONNS] scratch for store_attached_conns, sorted */
    uint64_t listen_paused_until; /* store_now_ms(): no fd left, listener unpolled until then */
    uint64_t shed_in_burst; /* connections shed since descriptors ran out (0 = they did not) */
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

/* Answer a request for a memfd (RING): "OK <bytes>" with the fd, or "ERR <why>". */
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
    backend_share sh;
    status s;
    char msg[FDSOCK_MSG_MAX];
    status_code rc = store_pool_share(fs->store, c->id, pool_id, &sh, &s);
    if (rc != ST_OK) {
        snprintf(msg, sizeof msg, "ERR %s", s.msg);
        reply(c->fd, msg, -1);
        return;
    }
    /* proto/kvstash_map.h: "OK <bytes>" and the memfd for host memory, the
     * IPC kind, GPU UUID and VMM fd or legacy handle for a device arena. The
     * fd goes only to this connection, whose SO_PEERCRED identity HELLO
     * checked; the daemon's copy is closed once sent. */
    if (kvstash_map_format(&sh.map, msg, sizeof msg) < 0)
        snprintf(msg, sizeof msg, "ERR cannot describe the pool's arena (kind %d)",
                 (int)sh.map.kind);
    reply(c->fd, msg, strncmp(msg, "OK", 2) == 0 ? sh.fd : -1);
    if (sh.fd >= 0)
        close(sh.fd);
}

static void handle_ring(fdsock *fs, conn *c)
{
    int fd = -1;
    size_t bytes = 0;
    status s;
    status_code rc = store_transport_fd(fs->store, c->id, ring_transport_open, fs->cfg.ring_bytes,
                                        &fd, &bytes, &s);
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

/* Close connection i unasked, telling the peer why first. */
static void conn_shed(fdsock *fs, size_t i, metrics_shed why, const char *text, uint64_t now)
{
    const conn *c = &fs->conns[i];
    log_info(why == METRICS_SHED_PENDING_CAP ? "pending_cap" : "pending_timeout",
             "conn=%d identified=%d idle_ms=%" PRIu64, c->id, c->identified, now - c->idle_since);
    reply(c->fd, text, -1);
    metrics_fdsock_shed(fs->cfg.metrics, why);
    conn_close(fs, i);
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Mark which connections have an attached session (idle_since 0) and since
 * when the others have none; returns how many have none. */
static size_t refresh_idle(fdsock *fs, uint64_t now)
{
    size_t n = store_attached_conns(fs->store, fs->attached, FDSOCK_MAX_CONNS);
    if (n > FDSOCK_MAX_CONNS)
        n = FDSOCK_MAX_CONNS; /* cannot happen: a session's conn is in the table */
    qsort(fs->attached, n, sizeof *fs->attached, cmp_int);
    size_t idle = 0;
    for (size_t i = 0; i < fs->nconns; i++) {
        conn *c = &fs->conns[i];
        if (bsearch(&c->id, fs->attached, n, sizeof *fs->attached, cmp_int) != NULL) {
            c->idle_since = 0;
            continue;
        }
        if (c->idle_since == 0)
            c->idle_since = now; /* its session ended: idle from now on */
        idle++;
    }
    return idle;
}

/* Every FDSOCK_TICK_MS: expire leases, then close the connections that had
 * no attached session for pending_timeout_ms (HELLO-only peers would
 * otherwise hold --max-sessions, and silent ones the table). */
static void tick(fdsock *fs, uint64_t now)
{
    if (fs->spare_fd < 0) /* lost to another thread when descriptors ran out */
        fs->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    store_expire_leases(fs->store);
    /* Quarantined blocks go back within a tick of their worker's exit;
     * polling the pidfds here (timeout 0) keeps them out of this thread's
     * poll set, whose slots are the connections'. */
    store_quarantine_reap(fs->store);
    refresh_idle(fs, now);
    char msg[FDSOCK_MSG_MAX];
    snprintf(msg, sizeof msg,
             "ERR closed: no attached session within %u ms (kvstashd --pending-timeout-ms)",
             fs->cfg.pending_timeout_ms);
    for (size_t i = fs->nconns; i-- > 0;) {
        const conn *c = &fs->conns[i];
        if (c->idle_since != 0 && now - c->idle_since >= fs->cfg.pending_timeout_ms)
            conn_shed(fs, i, METRICS_SHED_PENDING_TIMEOUT, msg, now);
    }
}

/* A new connection arrives with max_pending others pending: close the one
 * pending longest, so that a flood of silent peers delays an honest worker
 * by at most the time its own handshake takes. */
static void make_room(fdsock *fs, uint64_t now)
{
    size_t idle = 0;
    for (size_t i = 0; i < fs->nconns; i++)
        idle += fs->conns[i].idle_since != 0;
    /* Ask the store only near the cap: some of those may have attached since. */
    if (idle < fs->cfg.max_pending || refresh_idle(fs, now) < fs->cfg.max_pending)
        return;
    size_t oldest = SIZE_MAX;
    for (size_t i = 0; i < fs->nconns; i++) {
        const conn *c = &fs->conns[i];
        if (c->idle_since != 0 &&
            (oldest == SIZE_MAX || c->idle_since < fs->conns[oldest].idle_since ||
             (c->idle_since == fs->conns[oldest].idle_since && c->id < fs->conns[oldest].id)))
            oldest = i;
    }
    char msg[FDSOCK_MSG_MAX];
    snprintf(msg, sizeof msg,
             "ERR closed: %u connections were waiting to attach (kvstashd --max-pending); this "
             "was the oldest",
             fs->cfg.max_pending);
    if (oldest != SIZE_MAX)
        conn_shed(fs, oldest, METRICS_SHED_PENDING_CAP, msg, now);
}

/*
 * accept() failed for want of descriptors with a peer waiting: the listener
 * stays readable, and polling it again at once spun a core (issue 12).
 * Give up the spare descriptor to accept the peer and close it with a
 * reason, which drains the backlog one peer per turn; without a spare (a
 * thread took the number back), leave the listener unpolled for
 * FDSOCK_BACKOFF_MS. Logged once per burst; each shed peer is counted.
 */
static void out_of_fds(fdsock *fs, int err, uint64_t now)
{
    if (fs->shed_in_burst == 0)
        log_warn("fd_exhausted", "err=\"%s\" conns=%zu action=shedding_new_connections",
                 strerror(err), fs->nconns);
    int fd = -1;
    if (fs->spare_fd >= 0) {
        close(fs->spare_fd);
        fd = accept4(fs->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
            reply(fd, "ERR kvstashd is out of file descriptors; try again later", -1);
            close(fd);
            metrics_fdsock_shed(fs->cfg.metrics, METRICS_SHED_FD_LIMIT);
        }
        fs->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    fs->shed_in_burst++;
    if (fd < 0)
        fs->listen_paused_until = now + FDSOCK_BACKOFF_MS;
}

static void accept_one(fdsock *fs, uint64_t now)
{
    int fd = accept4(fs->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
            out_of_fds(fs, errno, now);
        return;
    }
    if (fs->shed_in_burst != 0) {
        log_info("fd_exhausted_end", "refused=%" PRIu64, fs->shed_in_burst);
        fs->shed_in_burst = 0;
    }
    make_room(fs, now);
    if (fs->nconns >= FDSOCK_MAX_CONNS) {
        reply(fd, "ERR too many connections", -1);
        close(fd);
        return;
    }
    fs->conns[fs->nconns++] = (conn){fd, fs->next_id++, 0, now};
}

static void *fdsock_thread(void *arg)
{
    fdsock *fs = arg;
    struct pollfd *pfd = calloc(FDSOCK_MAX_CONNS + 2, sizeof *pfd);
    if (pfd == NULL)
        return NULL;
    uint64_t next_tick = store_now_ms() + FDSOCK_TICK_MS;
    for (;;) {
        uint64_t now = store_now_ms();
        pfd[0] = (struct pollfd){fs->wake_fd, POLLIN, 0};
        /* A negative fd is skipped by poll: the listener rests while paused. */
        pfd[1] = (struct pollfd){now < fs->listen_paused_until ? -1 : fs->listen_fd, POLLIN, 0};
        for (size_t i = 0; i < fs->nconns; i++)
            pfd[i + 2] = (struct pollfd){fs->conns[i].fd, POLLIN, 0};
        size_t n = fs->nconns;
        int wait = now < next_tick ? (int)(next_tick - now) : 0;
        if (poll(pfd, n + 2, wait) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break;
        now = store_now_ms();
        /* Walk backwards: conn_close moves the last connection into slot i. */
        for (size_t i = n; i-- > 0;)
            if (pfd[i + 2].revents && conn_read(fs, &fs->conns[i]) != 0)
                conn_close(fs, i);
        if (pfd[1].revents & POLLIN)
            accept_one(fs, now);
        if (now >= next_tick) {
            tick(fs, now);
            next_tick = now + FDSOCK_TICK_MS;
        }
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

status_code fdsock_start(const char *path, store *st, const fdsock_config *cfg, fdsock **out,
                         status *s)
{
    *out = NULL;
    fdsock *fs = calloc(1, sizeof *fs);
    if (fs == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    fs->store = st;
    fs->cfg = *cfg;
    if (fs->cfg.max_pending == 0)
        fs->cfg.max_pending = 1;
    if (fs->cfg.ring_bytes == 0)
        fs->cfg.ring_bytes = RING_BYTES_DEFAULT;
    fs->listen_fd = -1;
    fs->wake_fd = eventfd(0, EFD_CLOEXEC);
    fs->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    fs->conns = calloc(FDSOCK_MAX_CONNS, sizeof *fs->conns);
    fs->attached = calloc(FDSOCK_MAX_CONNS, sizeof *fs->attached);
    if (fs->wake_fd < 0 || fs->spare_fd < 0 || fs->conns == NULL || fs->attached == NULL) {
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
    if (fs->spare_fd >= 0)
        close(fs->spare_fd);
    free(fs->conns);
    free(fs->attached);
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
    if (fs->spare_fd >= 0)
        close(fs->spare_fd);
    unlink(fs->path);
    free(fs->conns);
    free(fs->attached);
    free(fs);
}
