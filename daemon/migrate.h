/*
 * migrate.h - a sequence image (seq.h seq_export) as remote values and back
 * (issue 17, docs/remote.md "Export and import").
 *
 * Pure and I/O-free: encoding builds values in memory, decoding reads the
 * caller's bytes; the caller writes and reads the remote store
 * (remote_store.h) and takes and fills pool blocks. Thread-safe: no state.
 *
 * One export is one seq_uid's keys (remote_value.h remote_key, all in one
 * hash slot): a data value per (list, tier) that has blocks, a sketch value
 * per list that has a count-sketch, then the manifest. A reader fetches the
 * manifest, decodes it into a plan (migrate_decode_manifest), fetches the
 * data and sketch values the plan names, and decodes each into a host copy
 * of the export's blocks, or of a list's sketch cells (migrate_decode_data).
 *
 * Data values: key part "l<layer>.h<head>.<tier>" (tier: policy_tier_name,
 * "full", "int8", "int4", "int2"; head 0 for all-heads lists), kind
 * REMOTE_VALUE_TOKENS, tier, layer and head of the list; positions: the
 * list's held tokens stored in that tier (at[j].tier), ascending (none when
 * its blocks hold only victims); payload: the list's export blocks of that
 * tier, raw, in ascending export-index order, block_bytes each.
 *
 * Sketch values (format 2): key part "l<layer>.h<head>.sketch", kind
 * REMOTE_VALUE_SKETCH, tier POLICY_SKETCH, layer and head of the list;
 * positions: the list's held tokens in the sketch, ascending (none when it
 * holds only victims, or nothing); payload: the sketch's cells as
 * tier_sketch_save writes them (key floats, value floats, counts), whole
 * cells of tier_sketch_bytes_for(1, 1, dim) bytes, dim the list's floats a
 * row (head_dim for per-head lists, kv_heads * head_dim else). Their
 * geometry (rows, buckets) is the policy's, from its parameters:
 * seq_import checks the size against it.
 *
 * The manifest: key part "manifest", kind REMOTE_VALUE_MANIFEST, no
 * positions, payload one JSON object (UTF-8, compact). Its header carries
 * the pool geometry. Every field is required, none other is allowed (a new
 * field is a new format). Integers are JSON integers (never reals),
 * unsigned; "runs" below are flat arrays of ints:
 *
 *   format          2 when a list has a sketch, else 1 (what a daemon
 *                   from before format 2 imports: a rolling upgrade); a
 *                   format 1 manifest is format 2 without lists[].sketch
 *                   and without sketch runs
 *   ns, tenant, uid the ids of the keys (remote_key): every data key is
 *                   built from them
 *   policy          policy name, 1..63 bytes
 *   params          [[key, value], ...] the resolved parameters, in order
 *                   (at most POLICY_MAX_PARAMS; each string 1..63 / 0..63
 *                   bytes)
 *   label           0..128 bytes
 *   appended        tokens ever appended, <= 2^32
 *   unstepped, host_steps, requantized, victims_dropped   counters
 *   moved           [POLICY_TIERS] counters, by policy_tier
 *   layers, heads   >= 1; lists = layers * heads
 *   block_bytes     bytes of one pool block (kv_block_bytes of the geometry)
 *   quant_group     the INT4/INT2 group size of the writer's pool (must be
 *                   the reader's when an int4 or int2 value is present)
 *   nblocks         export blocks, numbered 0 .. nblocks-1
 *   data            [{key, list, tier, size, crc, blocks}, ...]: one per data
 *                   value. key: remote_key(ns, tenant, uid, its part), the
 *                   only key it may have; list: layer * heads + head; tier: 0 full,
 *                   1 int8, 4 int4, 5 int2 (policy_tier); size: the value's
 *                   bytes; crc: CRC-32 (checksum.h) of them; blocks: the export
 *                   indices its payload holds, strictly ascending, listed
 *                   one by one. Every export block is in exactly one entry,
 *                   whose list and tier are the block's.
 *   lists           [layers * heads] objects, list (l, k) at l * heads + k:
 *     ntokens       held tokens
 *     positions     runs [start, count, ...] (count >= 1, ascending, not
 *                   overlapping, start + count <= appended): the positions
 *     tiers         runs [tier, count, ...]: the host's decided tiers
 *     attn          null, or base64 (RFC 4648, padded) of ntokens IEEE-754
 *                   binary32 little-endian: exact, at 4/3 characters a byte
 *     at            runs [block, slot, count, ...]: at[j] for count tokens
 *                   is (block, slot + i); a token's storage tier is its
 *                   block's; a run [4294967295, 0, count] (block
 *                   MIGRATE_SKETCH_BLOCK, slot 0) is count tokens in the
 *                   list's sketch, each (TIER_NO_BLOCK, 0, POLICY_SKETCH)
 *                   (format 2, and only in a list whose sketch is not null)
 *     nvictims      offloaded victims
 *     victims       runs [start, count, ...] as positions
 *     victim_at     runs [block, slot, count, ...] as at
 *     victim_blocks [export index, ...] oldest first
 *     tail          null (decoded: has_tail 0, tail_block and
 *                   tail_next_slot 0), or [block, next_slot]
 *     demote_due    0..255: 0 none due, 1 tokens decided quantised, 2 victims
 *                   alone, 3 both (another value: either)
 *     sketch        null, or {key, size, crc}: the list's sketch value
 *                   (its key the only one it may have, its bytes and zlib
 *                   crc32 as data entries'); size - 64 - 4 * (held tokens in
 *                   the sketch) is the sketch's bytes (image sketch_bytes), a
 *                   positive multiple of a cell's. Format 2 only.
 *   states          [] for a policy without per-layer state, else [layers]
 *                   base64 strings: each layer's state as the policy wrote
 *                   it (policy_ops.export_layer); import_layer checks them
 *
 * For example (abridged):
 *
 *   {"format":2,"ns":"prod","tenant":"t7","uid":"9f2c…","policy":"tova",
 *    "params":[["window","64"]],"label":"chat 12","appended":40,"unstepped":0,
 *    ...,"nblocks":3,"data":[{"key":"kvs:prod:{t7:9f2c…}:l0.h0.full","list":0,
 *    "tier":0,"size":16512,"crc":3735928559,"blocks":[0,2]},...],
 *    "lists":[{"ntokens":20,"positions":[0,16,30,4],"tiers":[0,20],
 *    "attn":null,"at":[0,0,16,2,0,4],"nvictims":0,"victims":[],
 *    "victim_at":[],"victim_blocks":[],"tail":[2,4],"demote_due":0,
 *    "sketch":null},...]}
 *
 * Bounds the decoder applies before allocating (checking the image is
 * seq_import's): ntokens + nvictims <= appended <= 2^32, and, for a list
 * without a sketch, <= the list's blocks times 2 * block_bytes / head_dim
 * (a token's K and V row of one head take at least 2 bits a channel; a
 * sketch holds any number of tokens in its fixed cells, so a list with one
 * is bounded by appended, and the lists with one together by
 * MIGRATE_MAX_SKETCH_TOKENS); nblocks is
 * the count of blocks the data entries list (so at most the manifest's
 * length). A sketch's cells are allocated only when its value, fetched, has
 * the size the manifest says (migrate_decode_data).
 */
#ifndef KVSTASH_MIGRATE_H
#define KVSTASH_MIGRATE_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"
#include "remote_store.h"
#include "remote_value.h"
#include "seq.h"
#include "status.h"

#define MIGRATE_FORMAT 2        /* written when a list has a sketch; else 1 */
#define MIGRATE_FORMAT_OLDEST 1 /* the oldest read: exports live --remote-ttl-s */
/* The block of an `at` / `victim_at` run of tokens in the sketch. */
#define MIGRATE_SKETCH_BLOCK 4294967295u /* TIER_NO_BLOCK */
/* Tokens and victims the lists with a sketch may hold in all: no block
 * bounds them, so a manifest that claims billions would otherwise make the
 * decoder allocate for them (2^26: a 128k-token sequence's 32 layers x 8
 * per-head lists is 2^25). */
#define MIGRATE_MAX_SKETCH_TOKENS (1u << 26)
#define MIGRATE_MANIFEST_PART "manifest"

/* ---- encode -------------------------------------------------------------- */

/* An export's values, in the order to write them: data values, then the
 * manifest, kv[n - 1] (the commit point: a reader that finds the manifest
 * finds every value it names). kv[i].key and kv[i].val are malloc'd and
 * owned here: migrate_values_free. */
typedef struct migrate_values {
    remote_kv *kv;
    size_t n;
    size_t bytes; /* the values' bytes in all */
} migrate_values;

/*
 * Encode export x of a pool of geometry g (INT4/INT2 group size
 * quant_group: kv_lowbit_group, 0 meaning KV_LOWBIT_GROUP_DEFAULT as in
 * kv_layout; blocks of block_bytes bytes, kv_block_bytes) under the keys
 * of (ns, tenant, uid): bytes holds x->nblocks * block_bytes bytes, export
 * block i at i * block_bytes (NULL when nblocks is 0). Reads x and bytes,
 * copies what it keeps. Checks of x what the encoding needs (indices in
 * range, each token's and victim's block of its list and of its tier,
 * positions strictly ascending, counters below 2^63, strings that fit and
 * are UTF-8, sketch tokens only in a list with a sketch, as TIER_NO_BLOCK
 * slot 0, a sketch of whole cells). x's lists' sketch cells (sketch_bytes
 * of them) become their sketch values. *out is zeroed first and set on
 * success only.
 * Errors: ST_INVALID_ARGUMENT naming what is wrong (in x, a name
 * remote_key refuses, block_bytes not the geometry's);
 * ST_RESOURCE_EXHAUSTED when out of memory.
 */
status_code migrate_encode(const seq_export *x, const pool_geometry *g, uint32_t quant_group,
                           size_t block_bytes, const uint8_t *bytes, const char *ns,
                           const char *tenant, const char *uid, migrate_values *out, status *st);

/* Free the keys and values and zero v (a zeroed v is fine). */
void migrate_values_free(migrate_values *v);

/* ---- decode -------------------------------------------------------------- */

/* One data value to fetch: blocks of one tier of a list, or (tier
 * POLICY_SKETCH, no blocks) the list's sketch. */
typedef struct migrate_data {
    char *key;        /* its full key (owned by the plan) */
    uint32_t list;    /* layer * heads + head */
    uint8_t tier;     /* policy_tier: FULL, INT8, INT4, INT2, or SKETCH */
    size_t size;      /* the bytes it must have */
    uint32_t crc;     /* CRC-32 (checksum.h) of those bytes */
    uint32_t *blocks; /* [nblocks] export blocks its payload fills, in order (owned) */
    size_t nblocks;
    uint32_t ntokens; /* positions it carries: the list's held tokens of its tier */
} migrate_data;

/*
 * What a manifest says. image is the sequence, but the bytes of its
 * blocks: its arrays are each one malloc, as seq_export_free frees them
 * (per list positions, tiers, attn, at, victims, victim_at, victim_blocks,
 * sketch; lists; block_tier, block_list; NULL when empty); a list's
 * sketch_bytes is set by the manifest, its sketch (the cells) by
 * migrate_decode_data of its sketch value, NULL until then; image.blocks is NULL
 * (the writer's pool ids mean nothing here: the importer takes its own
 * blocks); image.params.key[i] points to param_keys[i], strings the plan
 * owns. Everything dies with migrate_plan_free (never seq_export_free the
 * image as well): seq_import must resolve the parameters against the
 * policy (whose keys are static) rather than keep these pointers.
 */
typedef struct migrate_plan {
    seq_export image;
    char *param_keys[POLICY_MAX_PARAMS];
    char ns[REMOTE_NAME_MAX + 1], tenant[REMOTE_NAME_MAX + 1], uid[REMOTE_NAME_MAX + 1];
    pool_geometry geom;   /* the reader's, as passed */
    uint32_t quant_group; /* the reader's, as passed (0 made KV_LOWBIT_GROUP_DEFAULT) */
    size_t block_bytes;   /* a host copy of the blocks is image.nblocks * block_bytes bytes */
    migrate_data *data;   /* [ndata] the values to fetch (owned): data entries, then sketches */
    char **data_keys;     /* [ndata] data[i].key, as remote_get takes keys */
    size_t ndata;
    uint32_t format; /* the manifest's (MIGRATE_FORMAT_OLDEST .. MIGRATE_FORMAT) */
} migrate_plan;

/*
 * Decode the manifest value buf[0..len) for a pool of geometry g whose
 * INT4/INT2 group size is quant_group (as migrate_encode's). Whether it
 * is the manifest asked for is migrate_plan_check_origin's. *out is zeroed
 * first, and holds nothing to free on failure. Never reads outside buf,
 * and allocates only what the bounds above allow. Errors:
 *   ST_DATA_LOSS            a value that does not decode (remote_value_decode),
 *                           is not a manifest, JSON that does not parse, a
 *                           field missing, mistyped, unexpected or out of
 *                           range (named: "manifest: lists[3].at: ..."), data
 *                           entries that do not match the lists (sizes,
 *                           keys, blocks listed twice)
 *   ST_FAILED_PRECONDITION  written for another geometry (the header's,
 *                           remote_value_check_geometry; block_bytes; the
 *                           quant_group when INT4/INT2 data is present), or
 *                           a format version this reader does not read
 *   ST_RESOURCE_EXHAUSTED   out of memory
 */
status_code migrate_decode_manifest(const void *buf, size_t len, const pool_geometry *g,
                                    uint32_t quant_group, migrate_plan *out, status *st);

/*
 * Whether the plan's keys are those of (ns, tenant, uid): a reader checks
 * that the manifest it fetched names the export it asked for (a manifest
 * copied under another key is stale). ST_OK or ST_DATA_LOSS naming the id
 * that differs.
 */
status_code migrate_plan_check_origin(const migrate_plan *p, const char *ns, const char *tenant,
                                      const char *uid, status *st);

/*
 * Check data value p->data[i] as fetched, buf[0..len), and copy its
 * blocks into bytes (p->image.nblocks * p->block_bytes bytes) at their
 * export indices, or a sketch value's cells into a malloc'd
 * p->image.lists[list].sketch (the plan's); nothing is written on failure.
 * A value that is missing is the caller's ST_NOT_FOUND. Errors:
 * ST_INVALID_ARGUMENT for i out of range; ST_RESOURCE_EXHAUSTED out of
 * memory (a sketch); else ST_DATA_LOSS naming the key and what differs:
 * size or crc against the manifest (truncated, stale, another value), a
 * value that does not decode, another geometry, kind, tier, layer or head,
 * or positions other than the list's held tokens of that tier.
 */
status_code migrate_decode_data(migrate_plan *p, size_t i, const void *buf, size_t len,
                                uint8_t *bytes, status *st);

/* migrate_decode_data without the copy of blocks: *blocks points into buf
 * at the value's blocks, p->data[i].blocks[k] at k * p->block_bytes (NULL
 * for a sketch value, whose cells go to the image as above), for a caller
 * that writes them straight into pool blocks. The same checks and errors. */
status_code migrate_check_data(migrate_plan *p, size_t i, const void *buf, size_t len,
                               const uint8_t **blocks, status *st);

/* Free everything the plan owns (the image's arrays included) and zero it;
 * a zeroed plan is fine. */
void migrate_plan_free(migrate_plan *p);

/* ---- spilled victims --------------------------------------------------- */

/*
 * A spilled victim block or sketch (seq.h "Spilling victims") is one value
 * under key part "v<part>" (seq_spill_key_part) of the sequence's remote
 * uid: kind REMOTE_VALUE_TOKENS with the block's tier, or
 * REMOTE_VALUE_SKETCH; its list's layer and head; the positions of the
 * victims it holds (ascending); payload the pool block's bytes, or the
 * sketch's cells (tier.h tier_sketch_save), raw. No manifest: the daemon
 * that spilled it keeps the rest (which victims are where, the sketch's
 * geometry) and is its only reader.
 *
 * migrate_encode_spill builds b's value from its b->bytes bytes (*out's key
 * and value malloc'd, the caller's: free both). migrate_decode_spill checks
 * a fetched value buf[0..len) of `key` against the part the sequence
 * expects and points *payload at its want->bytes bytes inside buf:
 * DATA_LOSS naming the key and what differs (a value that does not decode
 * or fails its checksum, another geometry, kind, tier, list, positions or
 * size).
 */
status_code migrate_encode_spill(const pool_geometry *g, uint32_t quant_group,
                                 const seq_spill_block *b, const uint8_t *bytes, const char *ns,
                                 const char *tenant, const char *uid, remote_kv *out, status *st);
status_code migrate_decode_spill(const void *buf, size_t len, const char *key,
                                 const pool_geometry *g, uint32_t quant_group,
                                 const seq_remote_part *want, const uint8_t **payload, status *st);

#endif
