/*
 * policy_replay.h - what `kvstash replay` (client/replay.c) hands a policy's
 * own trace operations (policy_ops.replay; ov_block's OpenVINO-terms
 * operations are the example, docs/replay.md).
 *
 * The replay stays generic: it owns the JSON library and the output, and
 * passes the line through a small read-only interface over its values, the
 * sequence's policy host, and functions that report an error on the line or
 * write the answer. A policy's replay code includes this header and
 * host.h, never a JSON header.
 */
#ifndef KVSTASH_POLICY_REPLAY_H
#define KVSTASH_POLICY_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "host.h"
#include "policy.h"

/* One JSON value of the trace line (opaque; the replay's). */
typedef struct policy_replay_value policy_replay_value;

typedef struct policy_replay {
    policy_host *host;               /* the sequence: views, append, step, commit */
    uint32_t layers;                 /* of the geometry */
    const policy_replay_value *line; /* the line's object */
    void *ctx;                       /* the replay's, first argument of every function */

    /* ---- reading (NULL, or a "no", for a value that is absent or of
     * another type) ---- */
    const policy_replay_value *(*field)(void *ctx, const policy_replay_value *obj, const char *key);
    int (*is_object)(void *ctx, const policy_replay_value *v);
    /* Elements of an array, or SIZE_MAX when v is not an array. */
    size_t (*array_size)(void *ctx, const policy_replay_value *v);
    const policy_replay_value *(*item)(void *ctx, const policy_replay_value *arr, size_t i);
    /* 0 and *out for a number, -1 otherwise. */
    int (*number)(void *ctx, const policy_replay_value *v, double *out);

    /* ---- the replay's checks: each reports the line and returns -1 ---- */
    /* Fields of obj other than keys (NULL-terminated) are errors. */
    int (*only_keys)(void *ctx, const policy_replay_value *obj, const char *const *keys,
                     const char *what);
    /* An integer in [0, max] (*out = 0 on error). */
    int (*get_uint)(void *ctx, const policy_replay_value *v, uint64_t max, uint64_t *out,
                    const char *what);
    /* The value must be JSON true. */
    int (*get_true)(void *ctx, const policy_replay_value *v, const char *op);
    int (*fail)(void *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
    void (*note)(void *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

    /* ---- the answer: text, then emit() writes it as one line ---- */
    void (*put)(void *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
    /* The shortest text that reads back as v (null for inf and nan). */
    void (*put_double)(void *ctx, double v);
    int (*emit)(void *ctx);
} policy_replay;

#endif
