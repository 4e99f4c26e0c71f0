/*
 * remote_value.h - the remote tier's keys and values (docs/remote.md): the
 * names under which a sequence's tokens are written to the remote store
 * (remote_store.h), and the bytes written there.
 *
 * Pure and I/O-free (remote_uid_new reads getrandom(2), nothing else):
 * building a key or a value touches only the caller's buffers, and decoding
 * a value gives views into the caller's bytes. Thread-safe: no state.
 *
 * Keys. Every key of one sequence is
 *
 *     kvs:<ns>:{<tenant>:<seq_uid>}:<part>
 *
 * The braces are a Redis Cluster hash tag: only `<tenant>:<seq_uid>` is
 * hashed, so all keys of a sequence live in one slot, on one node, and can
 * be written in one pipeline (or one MULTI). Keys are visible to whoever
 * operates the store (MONITOR, SCAN, slow logs): they must never hold
 * anything secret. Callers pass ids (a namespace from the config, a tenant
 * id, a seq_uid from remote_uid_new, a part they name themselves:
 * "manifest", "l3.h0.int8"), never labels, tokens, prompts or other user
 * text.
 *
 * Values. A value is a fixed header, the token positions, then the payload:
 * the tier's own bytes, opaque here. The header says what the bytes are
 * (kind, tier) and the whole geometry they were written under, so that a
 * reader refuses bytes written for another model or another quantisation
 * (remote_value_check_geometry) instead of misreading them. Wire layout,
 * every integer little-endian (docs/remote.md "Values"):
 *
 *     offset size field
 *          0    4 magic "KVSR"
 *          4    2 version (REMOTE_VALUE_VERSION = 1)
 *          6    2 header length (REMOTE_VALUE_HEADER_LEN = 64)
 *          8    1 kind (remote_value_kind)
 *          9    1 tier (policy_tier)
 *         10    1 dtype (pool_dtype)
 *         11    1 reserved, 0
 *         12    4 layers
 *         16    4 q_heads
 *         20    4 kv_heads
 *         24    4 head_dim
 *         28    4 block_tokens
 *         32    4 rope_theta (IEEE-754 binary32 bits)
 *         36    4 quant_group
 *         40    4 layer
 *         44    4 head
 *         48    4 ntokens
 *         52    8 payload_len
 *         60    4 CRC-32 (zlib's crc32_z; checksum.h) of the whole value, these 4 bytes as 0
 *         64  4*n positions, u32 each, strictly ascending
 *     64+4*n  len payload
 *
 * A value is exactly 64 + 4 * ntokens + payload_len bytes.
 */
#ifndef KVSTASH_REMOTE_VALUE_H
#define KVSTASH_REMOTE_VALUE_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"
#include "status.h"

/* ---- keys ---------------------------------------------------------------- */

#define REMOTE_NAME_MAX 64  /* ns, tenant, seq_uid: 1..64 of [A-Za-z0-9_.-] */
#define REMOTE_PART_MAX 128 /* part: 1..128 of [A-Za-z0-9_.:-] */
#define REMOTE_UID_LEN 32   /* remote_uid_new: lowercase hex */
/* A buffer this size holds any key remote_key builds, NUL included. */
#define REMOTE_KEY_CAP (4 + 3 * REMOTE_NAME_MAX + 5 + REMOTE_PART_MAX + 1)

/*
 * Write `kvs:<ns>:{<tenant>:<seq_uid>}:<part>` and its NUL into out[0..cap).
 * ns, tenant and seq_uid: 1..REMOTE_NAME_MAX characters of [A-Za-z0-9_.-]
 * (a daemon without tenants passes a fixed tenant id of its own, never "");
 * part: 1..REMOTE_PART_MAX characters of [A-Za-z0-9_.:-]. Ids only: see
 * "Keys" above. Errors: ST_INVALID_ARGUMENT naming the component and what
 * is wrong with it (empty, too long, the offending character and its
 * offset), or a cap smaller than the key; out is then "" when cap > 0.
 */
status_code remote_key(char *out, size_t cap, const char *ns, const char *tenant,
                       const char *seq_uid, const char *part, status *st);

/* 1 if s is a valid ns / tenant / seq_uid of at most maxlen characters
 * (1..maxlen of [A-Za-z0-9_.-]; pass REMOTE_NAME_MAX for what remote_key
 * accepts), else 0 (NULL included): for config validation. */
int remote_name_valid(const char *s, size_t maxlen);

/* A fresh seq_uid: REMOTE_UID_LEN lowercase hex characters (128 bits from
 * getrandom(2)) and a NUL. ST_INTERNAL when getrandom fails. */
status_code remote_uid_new(char out[REMOTE_UID_LEN + 1], status *st);

/* ---- values -------------------------------------------------------------- */

#define REMOTE_VALUE_MAGIC "KVSR"
#define REMOTE_VALUE_VERSION 1
#define REMOTE_VALUE_HEADER_LEN 64

/* What a value holds; its tier must be the one named here. */
typedef enum remote_value_kind {
    REMOTE_VALUE_TOKENS = 1,   /* a list's tokens of one stored tier: FULL, INT8, INT4 or INT2 */
    REMOTE_VALUE_SKETCH = 2,   /* a list's sketch cells; tier POLICY_SKETCH */
    REMOTE_VALUE_MANIFEST = 3, /* a sequence's description (JSON); tier POLICY_FULL,
                                  layer and head 0 */
} remote_value_kind;

/*
 * A value's header as the caller sees it (the wire adds magic, version,
 * header length and checksum). Constraints checked by both encode (else
 * ST_INVALID_ARGUMENT) and decode (else ST_DATA_LOSS):
 *  - kind a remote_value_kind, tier the one its kind allows (above), dtype
 *    a pool_dtype;
 *  - layers, q_heads, kv_heads, head_dim, block_tokens >= 1, rope_theta
 *    finite and > 0 (a checked pool geometry, pool_geometry_check);
 *  - quant_group >= 1 for POLICY_INT4 / POLICY_INT2 (the effective group,
 *    kernels.h kv_lowbit_group, never 0 for "default") and 0 otherwise;
 *  - layer < layers, head < kv_heads (a list that is not per head: 0).
 */
typedef struct remote_value_header {
    uint8_t kind;  /* remote_value_kind */
    uint8_t tier;  /* policy_tier of the payload */
    uint8_t dtype; /* pool_dtype of the pool the bytes came from */
    /* the pool geometry the bytes were written under */
    uint32_t layers, q_heads, kv_heads, head_dim, block_tokens;
    float rope_theta;
    uint32_t quant_group; /* INT4/INT2 group size; 0 otherwise */
    uint32_t layer, head; /* which list */
    uint32_t ntokens;     /* positions that follow the header */
    uint64_t payload_len; /* bytes after the positions */
} remote_value_header;

/* Bytes of the encoded value (header, positions, payload), or SIZE_MAX when
 * that does not fit in size_t. Does not check the header otherwise. */
size_t remote_value_size(const remote_value_header *h);

/* Where the payload starts in the encoded value: REMOTE_VALUE_HEADER_LEN +
 * 4 * ntokens (SIZE_MAX on overflow). */
size_t remote_value_payload_offset(const remote_value_header *h);

/*
 * Encode h, positions[0..h->ntokens) (strictly ascending) and
 * payload[0..h->payload_len) into out[0..remote_value_size(h)), checksum
 * included. positions may be NULL when ntokens is 0, payload when
 * payload_len is 0. The payload may already lie in out at
 * remote_value_payload_offset(h) (a caller that writes the tier's bytes
 * in place saves a copy); any other overlap with out is the caller's bug.
 * Errors: ST_INVALID_ARGUMENT for a header that breaks a constraint above,
 * positions not strictly ascending (naming the index), a NULL array that
 * is needed, a size that overflows, or cap < remote_value_size(h); out is
 * then unspecified.
 */
status_code remote_value_encode(const remote_value_header *h, const uint32_t *positions,
                                const void *payload, void *out, size_t cap, status *st);

/*
 * Decode the value buf[0..len) into *h, with *positions_le (h->ntokens u32
 * LE, read them with remote_value_position) and *payload (h->payload_len
 * bytes) pointing into buf: nothing is copied, buf must outlive them.
 * positions_le and payload may be NULL when the caller does not want them.
 * Strict, for bytes from a store that may hold anything: never reads
 * outside buf[0..len). Errors, ST_DATA_LOSS with a message naming what is
 * wrong: wrong magic, unknown version, header length, a length that does
 * not add up to exactly len (truncated or trailing bytes, or overflowing),
 * "checksum mismatch (stored X, computed Y)", a field breaking a
 * constraint above, positions not strictly ascending. *h, *positions_le
 * and *payload are set only on success.
 */
status_code remote_value_decode(const void *buf, size_t len, remote_value_header *h,
                                const uint8_t **positions_le, const uint8_t **payload, status *st);

/* Position i of a decoded value's positions (LE, possibly unaligned). */
static inline uint32_t remote_value_position(const uint8_t *positions_le, size_t i)
{
    const uint8_t *p = positions_le + 4 * i;
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/*
 * Whether a decoded value's bytes can be used by a pool of geometry g whose
 * INT4/INT2 group size is quant_group (kv_lowbit_group of its layout; only
 * compared when h->tier is POLICY_INT4 or POLICY_INT2). ST_OK, or
 * ST_FAILED_PRECONDITION naming the first field that differs, in the order
 * layers, q_heads, kv_heads, head_dim, block_tokens, dtype, rope_theta,
 * quant_group ("value written for head_dim 128, this pool has 64").
 */
status_code remote_value_check_geometry(const remote_value_header *h, const pool_geometry *g,
                                        uint32_t quant_group, status *st);

#endif
