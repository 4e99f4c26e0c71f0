/*
 * events.h - the daemon's event feed on a nanomsg PUB socket.
 *
 * Each message is "<topic> <json>"; every JSON object carries "n", the feed's
 * counter, so that a subscriber can see gaps (nanomsg drops under bursts,
 * C-STACK.md) and resynchronise through gRPC. Topics: docs/protocol.md.
 * Thread-safe.
 */
#ifndef KVSTASH_EVENTS_H
#define KVSTASH_EVENTS_H

#include <jansson.h>
#include <stdint.h>

#include "status.h"

typedef struct events events;

/* Bind a PUB socket at `url` (e.g. "ipc:///run/kvstash/kvstashd.sock.events"). */
status_code events_open(const char *url, events **out, status *st);

/* Publish `obj` under `topic`; takes the reference to obj. Never blocks: a
 * message nobody can take now is dropped, as nanomsg PUB does anyway. */
void events_publish(events *ev, const char *topic, json_t *obj);

/* Events published so far. */
uint64_t events_count(events *ev);

void events_close(events *ev);

#endif
