/*
 * fuzz_fdsock - the fd socket's message parser and handlers (daemon/fdsock.c)
 * through a real socket: a real fd-socket thread over a real store, and up
 * to FUZZ_MAX_CONNS SOCK_SEQPACKET connections sending what the input says.
 *
 * Input: [connections: 1 + byte % FUZZ_MAX_CONNS] then messages separated
 * by '\n' (at most FUZZ_MAX_MSGS), message i sent on connection
 * i % connections; each must be answered with "OK ..." or "ERR ...", or the
 * connection closed (an empty message ends it). When HELLO is answered with
 * a token, the harness attaches that session to model "m" (pool 1), as a
 * worker's next gRPC call would, so that MAP and RING reach their success
 * paths; descriptors that come back are closed.
 */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "fdsock.h"
#include "fuzz_store.h"

#define FUZZ_MAX_CONNS 3
#define FUZZ_MAX_MSGS 16
#define FUZZ_REPLY_MS                                                                              \
    60000 /* no answer this long is a hang: abort (generous: a busy host                           \
           * starves a nice 19 run for seconds) */

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char sock_path[108];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvs-fuzz-fdsock-%d", (int)getpid());
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        abort();
    snprintf(sock_path, sizeof sock_path, "%s/fd.sock", dir);
    return 0;
}

static int conn_open(void)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock_path);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
        abort();
    return fd;
}

/* Receive one answer; close what it carries. Returns its length, 0 when
 * the daemon closed the connection. */
static ssize_t conn_answer(int fd, char *buf, size_t cap)
{
    struct pollfd p = {fd, POLLIN, 0};
    int rc;
    /* libFuzzer's -timeout alarm interrupts poll every second: EINTR is no
     * hang (the wait restarts whole, so a hang takes longer to call). */
    while ((rc = poll(&p, 1, FUZZ_REPLY_MS)) < 0 && errno == EINTR)
        ;
    if (rc != 1) {
        fprintf(stderr, "fd socket: no answer within %d ms\n", FUZZ_REPLY_MS);
        abort();
    }
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {buf, cap - 1};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                int got;
                memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
                close(got);
            }
    if (n < 0)
        return 0; /* ECONNRESET: closed as well */
    buf[n] = '\0';
    return n;
}

/* Check an answer; attach the session a HELLO opened. */
static void on_answer(fuzz_store *f, const char *text)
{
    if (strncmp(text, "OK", 2) != 0 && strncmp(text, "ERR ", 4) != 0) {
        fprintf(stderr, "fd socket answered '%s'\n", text);
        abort();
    }
    if (strncmp(text, "OK ", 3) == 0 && strlen(text) == 3 + STORE_TOKEN_LEN) {
        store_attach_result ar;
        status s;
        store_attach(f->st, text + 3, "m", &fuzz_geometry, "fuzz", &ar, &s);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t nconns = 1 + data[0] % FUZZ_MAX_CONNS;
    data++;
    size--;
    fuzz_store f;
    fuzz_store_open(&f, 0);
    fdsock_config cfg = {.pending_timeout_ms = 60000, .max_pending = 8};
    fdsock *fs;
    status s;
    fuzz_check(fdsock_start(sock_path, f.st, &cfg, &fs, &s), &s, "fdsock_start");
    int conns[FUZZ_MAX_CONNS];
    for (size_t i = 0; i < nconns; i++)
        conns[i] = conn_open();
    for (int i = 0; i < FUZZ_MAX_MSGS && size > 0; i++) {
        const uint8_t *nl = memchr(data, '\n', size);
        size_t len = nl != NULL ? (size_t)(nl - data) : size;
        int fd = conns[i % nconns];
        if (fd >= 0) {
            char buf[512];
            if (send(fd, data, len, MSG_NOSIGNAL) < 0 || conn_answer(fd, buf, sizeof buf) == 0) {
                close(fd);
                conns[i % nconns] = -1;
            } else {
                on_answer(&f, buf);
            }
        }
        data += len + (nl != NULL);
        size -= len + (nl != NULL);
    }
    for (size_t i = 0; i < nconns; i++)
        if (conns[i] >= 0)
            close(conns[i]);
    fdsock_stop(fs);
    fuzz_store_close(&f);
    return 0;
}
