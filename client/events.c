/* events.c - the daemon's event feed (nanomsg SUB); see kvstash.h and
 * docs/protocol.md "Events". */
#include "kvstash.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nanomsg/nn.h>
#include <nanomsg/pubsub.h>

int kvs_events_open(const char *socket_path)
{
    if (socket_path == NULL)
        socket_path = kvs_default_socket();
    size_t len = strlen("ipc://") + strlen(socket_path) + strlen(".events") + 1;
    char *addr = malloc(len);
    if (addr == NULL)
        return KVS_ERR_SYSTEM;
    snprintf(addr, len, "ipc://%s.events", socket_path);
    int sock = nn_socket(AF_SP, NN_SUB);
    if (sock < 0) {
        free(addr);
        return KVS_ERR_SYSTEM;
    }
    /* nanomsg connects in the background and reconnects by itself: this
     * succeeds even before the daemon is up. */
    if (nn_setsockopt(sock, NN_SUB, NN_SUB_SUBSCRIBE, "", 0) < 0 || nn_connect(sock, addr) < 0) {
        int e = errno;
        nn_close(sock);
        free(addr);
        return e == EINVAL || e == ENAMETOOLONG ? KVS_ERR_INVALID : KVS_ERR_SYSTEM;
    }
    free(addr);
    return sock;
}

int kvs_events_next(int sock, int timeout_ms, char **event)
{
    if (event == NULL)
        return KVS_ERR_INVALID;
    *event = NULL;
    int to = timeout_ms < 0 ? -1 : timeout_ms;
    if (nn_setsockopt(sock, NN_SOL_SOCKET, NN_RCVTIMEO, &to, sizeof to) < 0)
        return errno == EBADF ? KVS_ERR_INVALID : KVS_ERR_SYSTEM;
    void *buf = NULL;
    int n = nn_recv(sock, &buf, NN_MSG, 0);
    if (n < 0) {
        /* A signal ends the wait like a timeout, so callers can check flags. */
        if (errno == ETIMEDOUT || errno == EAGAIN || errno == EINTR)
            return KVS_ERR_UNAVAILABLE;
        return errno == EBADF || errno == ENOTSUP ? KVS_ERR_INVALID : KVS_ERR_SYSTEM;
    }
    char *s = malloc((size_t)n + 1);
    if (s != NULL) {
        memcpy(s, buf, (size_t)n);
        s[n] = '\0';
    }
    nn_freemsg(buf);
    if (s == NULL)
        return KVS_ERR_SYSTEM;
    *event = s;
    return KVS_OK;
}

void kvs_events_close(int sock)
{
    if (sock >= 0)
        nn_close(sock);
}
