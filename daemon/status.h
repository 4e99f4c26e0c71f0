/*
 * status.h - the outcome of a daemon operation: a gRPC status code and a
 * message that tells the client what to fix.
 *
 * The codes have gRPC's numeric values so the RPC layer passes them through,
 * but this header does not include gRPC: the store stays testable without it.
 */
#ifndef KVSTASH_STATUS_H
#define KVSTASH_STATUS_H

#define STATUS_MSG_LEN 256

typedef enum status_code {
    ST_OK = 0,
    ST_CANCELLED = 1,
    ST_UNKNOWN = 2,
    ST_INVALID_ARGUMENT = 3,
    ST_DEADLINE_EXCEEDED = 4,
    ST_NOT_FOUND = 5,
    ST_ALREADY_EXISTS = 6,
    ST_PERMISSION_DENIED = 7,
    ST_RESOURCE_EXHAUSTED = 8,
    ST_FAILED_PRECONDITION = 9,
    ST_UNIMPLEMENTED = 12,
    ST_INTERNAL = 13,
    ST_UNAVAILABLE = 14,
    ST_DATA_LOSS = 15,
    ST_UNAUTHENTICATED = 16,
} status_code;

typedef struct status {
    status_code code;
    char msg[STATUS_MSG_LEN];
} status;

/* Set *st to `code` with a printf-style message; returns `code` so that
 * handlers can write `return status_set(st, ST_NOT_FOUND, "...", id);`. */
status_code status_set(status *st, status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The canonical upper-case name of a code ("NOT_FOUND"). */
const char *status_name(status_code code);

#endif
