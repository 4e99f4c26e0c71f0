#include "events.h"

#include <nanomsg/nn.h>
#include <nanomsg/pubsub.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

struct events {
    int sock;
    int endpoint;
    uint64_t count;
    pthread_mutex_t lock;
};

status_code events_open(const char *url, events **out, status *st)
{
    *out = NULL;
    events *ev = calloc(1, sizeof *ev);
    if (ev == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    pthread_mutex_init(&ev->lock, NULL);
    ev->sock = nn_socket(AF_SP, NN_PUB);
    if (ev->sock < 0) {
        status_set(st, ST_INTERNAL, "nn_socket: %s", nn_strerror(nn_errno()));
        goto fail;
    }
    ev->endpoint = nn_bind(ev->sock, url);
    if (ev->endpoint < 0) {
        status_set(st, ST_INTERNAL, "cannot bind event socket %s: %s", url,
                   nn_strerror(nn_errno()));
        goto fail;
    }
    *out = ev;
    return ST_OK;
fail:
    if (ev->sock >= 0)
        nn_close(ev->sock);
    pthread_mutex_destroy(&ev->lock);
    free(ev);
    return st->code;
}

void events_publish(events *ev, const char *topic, json_t *obj)
{
    if (ev == NULL || obj == NULL) {
        json_decref(obj);
        return;
    }
    pthread_mutex_lock(&ev->lock);
    json_object_set_new(obj, "n", json_integer((json_int_t)++ev->count));
    char *body = json_dumps(obj, JSON_COMPACT);
    if (body != NULL) {
        size_t tlen = strlen(topic), blen = strlen(body);
        char *msg = malloc(tlen + 1 + blen);
        if (msg != NULL) {
            memcpy(msg, topic, tlen);
            msg[tlen] = ' ';
            memcpy(msg + tlen + 1, body, blen);
            if (nn_send(ev->sock, msg, tlen + 1 + blen, NN_DONTWAIT) < 0)
                log_debug("event_dropped", "topic=%s err=\"%s\"", topic, nn_strerror(nn_errno()));
            free(msg);
        }
        free(body);
    }
    pthread_mutex_unlock(&ev->lock);
    json_decref(obj);
}

uint64_t events_count(events *ev)
{
    if (ev == NULL)
        return 0;
    pthread_mutex_lock(&ev->lock);
    uint64_t n = ev->count;
    pthread_mutex_unlock(&ev->lock);
    return n;
}

void events_close(events *ev)
{
    if (ev == NULL)
        return;
    nn_shutdown(ev->sock, ev->endpoint);
    nn_close(ev->sock);
    pthread_mutex_destroy(&ev->lock);
    free(ev);
}
