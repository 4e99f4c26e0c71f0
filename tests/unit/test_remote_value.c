/*
 * Unit tests of daemon/remote_value.h: the remote tier's keys (exact
 * strings, the hash tag, every validation error), seq_uids (format,
 * uniqueness), and the value codec: the wire layout byte by byte, seeded
 * round trips of every kind and tier (0 tokens and 0-byte payloads
 * included, in place and unaligned), and the strict decoder: every
 * single-bit flip, every truncation, trailing bytes, overflowing lengths,
 * positions out of order and each field out of range are DATA_LOSS; the
 * geometry check names the field that differs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <zlib.h>

#include "policy.h"
#include "remote_value.h"

/* ---- helpers ------------------------------------------------------------- */

/* splitmix64: the tests' only randomness, seeded. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static const pool_geometry geom = {4, 8, 2, 64, 16, POOL_FP16, 10000.0f};

/* A valid header of kind/tier over geom. */
static remote_value_header header_for(uint8_t kind, uint8_t tier, uint32_t ntokens,
                                      uint64_t payload_len)
{
    remote_value_header h = {
        .kind = kind,
        .tier = tier,
        .dtype = (uint8_t)geom.dtype,
        .layers = geom.layers,
        .q_heads = geom.q_heads,
        .kv_heads = geom.kv_heads,
        .head_dim = geom.head_dim,
        .block_tokens = geom.block_tokens,
        .rope_theta = geom.rope_theta,
        .quant_group = (tier == POLICY_INT4 || tier == POLICY_INT2) ? 32 : 0,
        .layer = kind == REMOTE_VALUE_MANIFEST ? 0 : 3,
        .head = kind == REMOTE_VALUE_MANIFEST ? 0 : 1,
        .ntokens = ntokens,
        .payload_len = payload_len,
    };
    return h;
}

static void assert_header_equal(const remote_value_header *a, const remote_value_header *b)
{
    assert_int_equal(a->kind, b->kind);
    assert_int_equal(a->tier, b->tier);
    assert_int_equal(a->dtype, b->dtype);
    assert_int_equal(a->layers, b->layers);
    assert_int_equal(a->q_heads, b->q_heads);
    assert_int_equal(a->kv_heads, b->kv_heads);
    assert_int_equal(a->head_dim, b->head_dim);
    assert_int_equal(a->block_tokens, b->block_tokens);
    assert_memory_equal(&a->rope_theta, &b->rope_theta, sizeof a->rope_theta);
    assert_int_equal(a->quant_group, b->quant_group);
    assert_int_equal(a->layer, b->layer);
    assert_int_equal(a->head, b->head);
    assert_int_equal(a->ntokens, b->ntokens);
    assert_true(a->payload_len == b->payload_len);
}

/* A small encoded value (TOKENS, INT8, 3 positions, 5 payload bytes); the
 * caller frees. */
static uint8_t *small_value(size_t *len)
{
    remote_value_header h = header_for(REMOTE_VALUE_TOKENS, POLICY_INT8, 3, 5);
    const uint32_t pos[3] = {2, 7, 40};
    const uint8_t payload[5] = {1, 2, 3, 4, 5};
    *len = remote_value_size(&h);
    uint8_t *v = malloc(*len);
    assert_non_null(v);
    status st;
    assert_int_equal(remote_value_encode(&h, pos, payload, v, *len, &st), ST_OK);
    return v;
}

/* Recompute the checksum of a value changed by hand (remote_value.h: CRC-32
 * at offset 60 over the whole value, the field as zeros). */
static void reseal(uint8_t *v, size_t len)
{
    memset(v + 60, 0, 4);
    uint32_t c = (uint32_t)crc32_z(0L, v, len);
    for (int i = 0; i < 4; i++)
        v[60 + i] = (uint8_t)(c >> (8 * i));
}

static void put32le(uint8_t *p, uint32_t x)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(x >> (8 * i));
}

/* Decode from a heap copy of exactly len bytes (so that ASan sees any read
 * past the end) and expect DATA_LOSS whose message contains `want` (NULL:
 * any), *h left untouched. */
static void expect_data_loss(const uint8_t *v, size_t len, const char *want)
{
    uint8_t *copy = malloc(len > 0 ? len : 1);
    assert_non_null(copy);
    if (len > 0)
        memcpy(copy, v, len);
    remote_value_header h;
    memset(&h, 0xa5, sizeof h);
    const uint8_t *pos = (const uint8_t *)&h, *pay = (const uint8_t *)&h;
    status st = {0};
    assert_int_equal(remote_value_decode(copy, len, &h, &pos, &pay, &st), ST_DATA_LOSS);
    if (want != NULL && strstr(st.msg, want) == NULL)
        fail_msg("message \"%s\" lacks \"%s\"", st.msg, want);
    assert_int_equal(h.kind, 0xa5);
    assert_ptr_equal(pos, (const uint8_t *)&h);
    assert_ptr_equal(pay, (const uint8_t *)&h);
    free(copy);
}

/* ---- keys ---------------------------------------------------------------- */

static void test_key_exact_strings_and_hash_tag(void **state)
{
    (void)state;
    char key[REMOTE_KEY_CAP];
    status st;
    assert_int_equal(remote_key(key, sizeof key, "prod", "t1", "0123abcd", "manifest", &st), ST_OK);
    assert_string_equal(key, "kvs:prod:{t1:0123abcd}:manifest");
    assert_int_equal(remote_key(key, sizeof key, "a-b.c_D", "T_9", "x.y-z", "l3.h0:int8", &st),
                     ST_OK);
    assert_string_equal(key, "kvs:a-b.c_D:{T_9:x.y-z}:l3.h0:int8");

    /* The hash tag is the first {...}: exactly "tenant:seq_uid", the only
     * braces in the key. */
    const char *open = strchr(key, '{'), *close = strchr(key, '}');
    assert_non_null(open);
    assert_non_null(close);
    assert_ptr_equal(strrchr(key, '{'), open);
    assert_ptr_equal(strrchr(key, '}'), close);
    assert_int_equal(close - open - 1, (int)strlen("T_9:x.y-z"));
    assert_memory_equal(open + 1, "T_9:x.y-z", strlen("T_9:x.y-z"));

    /* The longest key fills REMOTE_KEY_CAP exactly; one byte less fails. */
    char n64[REMOTE_NAME_MAX + 1], p128[REMOTE_PART_MAX + 1];
    memset(n64, 'n', REMOTE_NAME_MAX);
    n64[REMOTE_NAME_MAX] = '\0';
    memset(p128, 'p', REMOTE_PART_MAX);
    p128[REMOTE_PART_MAX] = '\0';
    assert_int_equal(remote_key(key, sizeof key, n64, n64, n64, p128, &st), ST_OK);
    assert_int_equal(strlen(key), REMOTE_KEY_CAP - 1);
    key[0] = 'x';
    assert_int_equal(remote_key(key, REMOTE_KEY_CAP - 1, n64, n64, n64, p128, &st),
                     ST_INVALID_ARGUMENT);
    assert_string_equal(key, "");
    assert_non_null(strstr(st.msg, "needs 330 bytes, the buffer has 329"));

    /* cap: the NUL counts. */
    const char *want = "kvs:n:{t:u}:p";
    assert_int_equal(remote_key(key, strlen(want) + 1, "n", "t", "u", "p", &st), ST_OK);
    assert_string_equal(key, want);
    assert_int_equal(remote_key(key, strlen(want), "n", "t", "u", "p", &st), ST_INVALID_ARGUMENT);
    assert_int_equal(remote_key(NULL, 0, "n", "t", "u", "p", &st), ST_INVALID_ARGUMENT);
}

typedef struct bad_key {
    int id;
    const char *ns, *tenant, *uid, *part;
    const char *msg;
} bad_key;

static const char long65[] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
static const char long129[] = "pppppppppppppppppppppppppppppppppppppppppppppppppppppppppppppppp"
                              "ppppppppppppppppppppppppppppppppppppppppppppppppppppppppppppppppp";

static void test_key_rejections_name_the_component(void **state)
{
    (void)state;
    assert_int_equal(strlen(long65), 65);
    assert_int_equal(strlen(long129), 129);
    static const bad_key cases[] = {
        {1, "", "t", "u", "p", "remote key: ns is empty"},
        {2, NULL, "t", "u", "p", "remote key: ns is empty"},
        {3, "n", "", "u", "p", "remote key: tenant is empty"},
        {4, "n", "t", "", "p", "remote key: seq_uid is empty"},
        {5, "n", "t", "u", "", "remote key: part is empty"},
        {6, long65, "t", "u", "p", "remote key: ns is longer than 64 characters"},
        {7, "n", long65, "u", "p", "remote key: tenant is longer than 64 characters"},
        {8, "n", "t", long65, "p", "remote key: seq_uid is longer than 64 characters"},
        {9, "n", "t", "u", long129, "remote key: part is longer than 128 characters"},
        {10, "n:s", "t", "u", "p", "remote key: ns has ':' at offset 1; only [A-Za-z0-9_.-]"},
        {11, "n", "te{n", "u", "p", "remote key: tenant has '{' at offset 2"},
        {12, "n", "t", "u}", "p", "remote key: seq_uid has '}' at offset 1"},
        {13, "n", "t:x", "u", "p", "remote key: tenant has ':' at offset 1"},
        {14, "n", "t", "u", "a{b}", "remote key: part has '{' at offset 1; only [A-Za-z0-9_.:-]"},
        {15, "n", "t", "u", "ab}", "remote key: part has '}' at offset 2"},
        {16, "n s", "t", "u", "p", "remote key: ns has byte 0x20 at offset 1"},
        {17, "n", "t\n", "u", "p", "remote key: tenant has byte 0x0a at offset 1"},
        {18, "n", "t", "\xc3\xa9", "p", "remote key: seq_uid has byte 0xc3 at offset 0"},
        {19, "n", "t", "u", "p*", "remote key: part has '*' at offset 1"},
        {20, "n", "t/x", "u", "p", "remote key: tenant has '/' at offset 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_key *c = &cases[i];
        char key[REMOTE_KEY_CAP];
        status st = {0};
        key[0] = 'x';
        if (remote_key(key, sizeof key, c->ns, c->tenant, c->uid, c->part, &st) !=
            ST_INVALID_ARGUMENT)
            fail_msg("case %d accepted", c->id);
        if (strstr(st.msg, c->msg) == NULL)
            fail_msg("case %d: \"%s\" lacks \"%s\"", c->id, st.msg, c->msg);
        assert_string_equal(key, "");
    }
}

static void test_name_valid(void **state)
{
    (void)state;
    assert_true(remote_name_valid("prod-1.a_B", REMOTE_NAME_MAX));
    assert_true(remote_name_valid("abc", 3));
    assert_false(remote_name_valid("abcd", 3));
    assert_false(remote_name_valid("", REMOTE_NAME_MAX));
    assert_false(remote_name_valid(NULL, REMOTE_NAME_MAX));
    assert_false(remote_name_valid("a:b", REMOTE_NAME_MAX));
    assert_false(remote_name_valid("a{b", REMOTE_NAME_MAX));
    assert_false(remote_name_valid("a b", REMOTE_NAME_MAX));
    assert_false(remote_name_valid(long65, REMOTE_NAME_MAX));
    assert_true(remote_name_valid(long65 + 1, REMOTE_NAME_MAX));
}

static int cmp_uid(const void *a, const void *b)
{
    return strcmp(a, b);
}

static void test_uid_format_and_uniqueness(void **state)
{
    (void)state;
    enum { N = 1000 };
    char(*uids)[REMOTE_UID_LEN + 1] = calloc(N, sizeof *uids);
    assert_non_null(uids);
    status st;
    for (int i = 0; i < N; i++) {
        assert_int_equal(remote_uid_new(uids[i], &st), ST_OK);
        assert_int_equal(strlen(uids[i]), REMOTE_UID_LEN);
        for (int j = 0; j < REMOTE_UID_LEN; j++) {
            char c = uids[i][j];
            assert_true((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
        }
        assert_true(remote_name_valid(uids[i], REMOTE_NAME_MAX));
    }
    qsort(uids, N, sizeof *uids, cmp_uid);
    for (int i = 1; i < N; i++)
        assert_string_not_equal(uids[i - 1], uids[i]);
    free(uids);
}

/* ---- values: layout and round trips ------------------------------------- */

static void test_wire_layout(void **state)
{
    (void)state;
    remote_value_header h = header_for(REMOTE_VALUE_TOKENS, POLICY_INT4, 2, 3);
    h.rope_theta = 500000.0f;
    const uint32_t pos[2] = {5, 0x01020304};
    const uint8_t payload[3] = {0xaa, 0xbb, 0xcc};
    assert_int_equal(remote_value_size(&h), 64 + 8 + 3);
    assert_int_equal(remote_value_payload_offset(&h), 72);
    uint8_t v[75];
    status st;
    assert_int_equal(remote_value_encode(&h, pos, payload, v, sizeof v, &st), ST_OK);
    float theta = 500000.0f;
    uint32_t tb;
    memcpy(&tb, &theta, 4);
    uint8_t want[75] = {0};
    memcpy(want, "KVSR\x01\x00\x40\x00", 8); /* magic, version 1, header length 64 */
    want[8] = REMOTE_VALUE_TOKENS;
    want[9] = POLICY_INT4;
    want[10] = POOL_FP16;   /* and 11, reserved, 0 */
    put32le(want + 12, 4);  /* layers */
    put32le(want + 16, 8);  /* q_heads */
    put32le(want + 20, 2);  /* kv_heads */
    put32le(want + 24, 64); /* head_dim */
    put32le(want + 28, 16); /* block_tokens */
    put32le(want + 32, tb); /* rope_theta */
    put32le(want + 36, 32); /* quant_group */
    put32le(want + 40, 3);  /* layer */
    put32le(want + 44, 1);  /* head */
    put32le(want + 48, 2);  /* ntokens */
    put32le(want + 52, 3);  /* payload_len, low half */
    put32le(want + 56, 0);  /* payload_len, high half */
    put32le(want + 64, 5);  /* positions */
    put32le(want + 68, 0x01020304);
    memcpy(want + 72, payload, 3);
    uint32_t crc = (uint32_t)crc32_z(0L, want, sizeof want); /* checksum field 0 */
    put32le(want + 60, crc);
    assert_memory_equal(v, want, sizeof want);
    assert_int_equal(remote_value_position(v + 64, 1), 0x01020304);
}

/* Every kind with its tiers, at several sizes, with seeded positions and
 * payloads: encode into exactly remote_value_size bytes (a canary after
 * them), decode, and get back the header, positions and payload (a view at
 * its offset). The same bytes decode from an odd address; the payload
 * encoded in place gives the same bytes. */
static void test_round_trips(void **state)
{
    (void)state;
    static const uint8_t kt[][2] = {
        {REMOTE_VALUE_TOKENS, POLICY_FULL},   {REMOTE_VALUE_TOKENS, POLICY_INT8},
        {REMOTE_VALUE_TOKENS, POLICY_INT4},   {REMOTE_VALUE_TOKENS, POLICY_INT2},
        {REMOTE_VALUE_SKETCH, POLICY_SKETCH}, {REMOTE_VALUE_MANIFEST, POLICY_FULL},
    };
    static const uint32_t ntok[] = {0, 1, 17, 300};
    static const uint64_t plen[] = {0, 1, 1000};
    uint64_t seed = 20240611;
    for (size_t k = 0; k < sizeof kt / sizeof kt[0]; k++)
        for (size_t a = 0; a < sizeof ntok / sizeof ntok[0]; a++)
            for (size_t b = 0; b < sizeof plen / sizeof plen[0]; b++) {
                remote_value_header h = header_for(kt[k][0], kt[k][1], ntok[a], plen[b]);
                h.dtype = (uint8_t)(1 + rng_next(&seed) % 3);
                uint32_t *pos = malloc((ntok[a] + 1) * sizeof *pos);
                uint8_t *pay = malloc(plen[b] + 1);
                assert_non_null(pos);
                assert_non_null(pay);
                /* Ascending with gaps; near UINT32_MAX some of the time. */
                uint32_t p = (rng_next(&seed) & 1) ? (uint32_t)(rng_next(&seed) % 1000)
                                                   : UINT32_MAX - 5 * ntok[a];
                for (uint32_t i = 0; i < ntok[a]; i++) {
                    pos[i] = p;
                    p += 1 + (uint32_t)(rng_next(&seed) % 5);
                }
                for (uint64_t i = 0; i < plen[b]; i++)
                    pay[i] = (uint8_t)rng_next(&seed);

                size_t size = remote_value_size(&h);
                assert_int_equal(size, 64 + 4 * (size_t)ntok[a] + plen[b]);
                uint8_t *v = malloc(size + 2);
                assert_non_null(v);
                v[size] = 0x5a;
                status st;
                assert_int_equal(remote_value_encode(&h, ntok[a] ? pos : NULL, plen[b] ? pay : NULL,
                                                     v, size, &st),
                                 ST_OK);
                assert_int_equal(v[size], 0x5a);
                /* One byte short is refused. */
                assert_int_equal(remote_value_encode(&h, pos, pay, v, size - 1, &st),
                                 ST_INVALID_ARGUMENT);
                assert_int_equal(remote_value_encode(&h, pos, pay, v, size, &st), ST_OK);

                remote_value_header d;
                const uint8_t *dpos, *dpay;
                assert_int_equal(remote_value_decode(v, size, &d, &dpos, &dpay, &st), ST_OK);
                assert_header_equal(&d, &h);
                assert_ptr_equal(dpos, v + 64);
                assert_ptr_equal(dpay, v + 64 + 4 * (size_t)ntok[a]);
                for (uint32_t i = 0; i < ntok[a]; i++)
                    assert_int_equal(remote_value_position(dpos, i), pos[i]);
                if (plen[b] > 0)
                    assert_memory_equal(dpay, pay, plen[b]);

                /* Unaligned: the same bytes one past an aligned address. */
                uint8_t *odd = malloc(size + 1);
                assert_non_null(odd);
                memcpy(odd + 1, v, size);
                assert_int_equal(remote_value_decode(odd + 1, size, &d, NULL, &dpay, &st), ST_OK);
                assert_ptr_equal(dpay, odd + 1 + 64 + 4 * (size_t)ntok[a]);
                for (uint32_t i = 0; i < ntok[a]; i++)
                    assert_int_equal(remote_value_position(odd + 1 + 64, i), pos[i]);

                /* In place: the payload written at its offset first. */
                memset(odd, 0, size + 1);
                size_t off = remote_value_payload_offset(&h);
                if (plen[b] > 0)
                    memcpy(odd + off, pay, plen[b]);
                assert_int_equal(remote_value_encode(&h, pos, odd + off, odd, size, &st), ST_OK);
                assert_memory_equal(odd, v, size);
                free(odd);
                free(v);
                free(pay);
                free(pos);
            }
}

/* ---- values: the strict decoder ----------------------------------------- */

static void test_every_bit_flip_is_rejected(void **state)
{
    (void)state;
    size_t len;
    uint8_t *v = small_value(&len);
    size_t checksum = 0;
    for (size_t bit = 0; bit < 8 * len; bit++) {
        v[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        expect_data_loss(v, len, NULL);
        status st;
        remote_value_header h;
        remote_value_decode(v, len, &h, NULL, NULL, &st);
        checksum += strstr(st.msg, "checksum mismatch (stored 0x") != NULL;
        v[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
    /* Outside magic, version, header length and the two lengths, the
     * checksum is what catches a flip. */
    assert_true(checksum >= 8 * (len - 4 - 2 - 2 - 4 - 8));
    remote_value_header h;
    status st;
    assert_int_equal(remote_value_decode(v, len, &h, NULL, NULL, &st), ST_OK);
    free(v);
}

static void test_every_truncation_and_trailing_bytes_rejected(void **state)
{
    (void)state;
    size_t len;
    uint8_t *v = small_value(&len);
    for (size_t n = 0; n < len; n++)
        expect_data_loss(v, n, n < 4 ? "no \"KVSR\" magic" : NULL);
    expect_data_loss(v, 40, "truncated at 40 bytes, in the 64-byte header");
    expect_data_loss(v, len - 1, "truncated");
    uint8_t *more = calloc(len + 8, 1);
    assert_non_null(more);
    memcpy(more, v, len);
    for (size_t extra = 1; extra <= 8; extra++)
        expect_data_loss(more, len + extra, "trailing bytes");
    free(more);
    free(v);
}

static void test_overflowing_lengths_rejected(void **state)
{
    (void)state;
    size_t len;
    uint8_t *v = small_value(&len);
    /* payload_len UINT64_MAX; one that overflows size_t by one with 3
     * positions; one whose total is exactly SIZE_MAX (the sentinel). */
    const uint64_t bad[] = {UINT64_MAX, (uint64_t)SIZE_MAX - 64 - 12 + 1,
                            (uint64_t)SIZE_MAX - 64 - 12};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int b = 0; b < 8; b++)
            v[52 + b] = (uint8_t)(bad[i] >> (8 * b));
        reseal(v, len);
        expect_data_loss(v, len, "header lengths overflow");
        remote_value_header h = header_for(REMOTE_VALUE_TOKENS, POLICY_INT8, 3, bad[i]);
        assert_int_equal(remote_value_size(&h), SIZE_MAX);
        status st;
        uint32_t pos[3] = {1, 2, 3};
        assert_int_equal(remote_value_encode(&h, pos, "x", v, len, &st), ST_INVALID_ARGUMENT);
        assert_non_null(strstr(st.msg, "overflow size_t"));
    }
    /* ntokens UINT32_MAX with a small payload: lengths that do not add up. */
    free(v);
    v = small_value(&len);
    put32le(v + 48, UINT32_MAX);
    reseal(v, len);
    expect_data_loss(v, len, "truncated");
    free(v);
}

static void test_positions_must_ascend(void **state)
{
    (void)state;
    remote_value_header h = header_for(REMOTE_VALUE_TOKENS, POLICY_FULL, 3, 0);
    uint8_t v[64 + 12];
    status st;
    const uint32_t equal[3] = {1, 5, 5}, down[3] = {9, 4, 10};
    assert_int_equal(remote_value_encode(&h, equal, NULL, v, sizeof v, &st), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "position 2 (5) does not follow 5"));
    assert_int_equal(remote_value_encode(&h, down, NULL, v, sizeof v, &st), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "position 1 (4) does not follow 9"));
    assert_int_equal(remote_value_encode(&h, NULL, NULL, v, sizeof v, &st), ST_INVALID_ARGUMENT);

    const uint32_t ok[3] = {1, 5, 6};
    assert_int_equal(remote_value_encode(&h, ok, NULL, v, sizeof v, &st), ST_OK);
    put32le(v + 64 + 8, 5); /* 1, 5, 5 */
    reseal(v, sizeof v);
    expect_data_loss(v, sizeof v, "position 2 (5) does not follow 5: positions are not strictly");
    put32le(v + 64 + 8, 0); /* 1, 5, 0 */
    reseal(v, sizeof v);
    expect_data_loss(v, sizeof v, "position 2 (0) does not follow 5");
}

/* One byte (or u32) of a valid value changed and resealed, and what the
 * decoder must say; the same header given to encode is INVALID_ARGUMENT. */
typedef struct bad_field {
    int id;
    size_t off;
    int width; /* 1 or 4 */
    uint32_t value;
    const char *msg;
    int resealed; /* 0: the checksum is left stale (checked before it) */
} bad_field;

static void test_fields_out_of_range(void **state)
{
    (void)state;
    float nan = NAN, inf = INFINITY, neg = -1.0f;
    uint32_t nan_bits, inf_bits, neg_bits;
    memcpy(&nan_bits, &nan, 4);
    memcpy(&inf_bits, &inf, 4);
    memcpy(&neg_bits, &neg, 4);
    const bad_field cases[] = {
        {1, 0, 1, 'k', "no \"KVSR\" magic", 0},
        {2, 4, 1, 2, "format version 2, this kvstashd reads version 1", 0},
        {3, 4, 1, 0, "format version 0", 0},
        {4, 6, 1, 65, "header length 65, version 1 has 64 bytes", 0},
        {5, 6, 1, 60, "header length 60", 0},
        {6, 8, 1, 0, "kind 0 is not 1 (tokens), 2 (sketch) or 3 (manifest)", 1},
        {7, 8, 1, 4, "kind 4 is not", 1},
        {8, 9, 1, POLICY_EVICT, "tier 3 is not a stored tier", 1},
        {9, 9, 1, POLICY_TIERS, "tier 6 is not a stored tier", 1},
        {10, 9, 1, POLICY_SKETCH, "tier sketch in a tokens value", 1},
        {11, 8, 1, REMOTE_VALUE_SKETCH, "tier int8 in a sketch value", 1},
        {12, 8, 1, REMOTE_VALUE_MANIFEST, "tier int8 in a manifest value", 1},
        {13, 10, 1, 0, "dtype 0 is not 1 (fp16), 2 (bf16) or 3 (fp32)", 1},
        {14, 10, 1, 4, "dtype 4 is not", 1},
        {15, 11, 1, 1, "reserved byte is 0x01, not 0", 1},
        {16, 12, 4, 0, "layers is 0", 1},
        {17, 16, 4, 0, "q_heads is 0", 1},
        {18, 20, 4, 0, "kv_heads is 0", 1},
        {19, 24, 4, 0, "head_dim is 0", 1},
        {20, 28, 4, 0, "block_tokens is 0", 1},
        {21, 32, 4, 0, "rope_theta 0 is not a positive number", 1},
        {22, 32, 4, nan_bits, "rope_theta nan is not a positive number", 1},
        {23, 32, 4, inf_bits, "rope_theta inf is not", 1},
        {24, 32, 4, neg_bits, "rope_theta -1 is not", 1},
        {25, 36, 4, 32, "quant_group 32 for tier int8 (want 0)", 1},
        {26, 9, 1, POLICY_INT4, "quant_group 0 for tier int4 (want >= 1)", 1},
        {27, 40, 4, 4, "layer 4 of 4 layers", 1},
        {28, 44, 4, 2, "head 2 of 2 kv_heads", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_field *c = &cases[i];
        size_t len;
        uint8_t *v = small_value(&len);
        if (c->width == 1)
            v[c->off] = (uint8_t)c->value;
        else
            put32le(v + c->off, c->value);
        if (c->resealed)
            reseal(v, len);
        uint8_t *copy = malloc(len);
        assert_non_null(copy);
        memcpy(copy, v, len);
        remote_value_header h;
        status st = {0};
        if (remote_value_decode(copy, len, &h, NULL, NULL, &st) != ST_DATA_LOSS)
            fail_msg("case %d accepted", c->id);
        if (strstr(st.msg, c->msg) == NULL)
            fail_msg("case %d: \"%s\" lacks \"%s\"", c->id, st.msg, c->msg);
        free(copy);
        free(v);
    }

    /* A manifest names no list; encode refuses what decode would. */
    remote_value_header h = header_for(REMOTE_VALUE_MANIFEST, POLICY_FULL, 0, 2);
    h.layer = 1;
    uint8_t out[66];
    status st;
    assert_int_equal(remote_value_encode(&h, NULL, "{}", out, sizeof out, &st),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "a manifest for layer 1 head 0 (want 0, 0)"));
    h = header_for(REMOTE_VALUE_TOKENS, POLICY_INT2, 0, 2);
    h.quant_group = 0;
    assert_int_equal(remote_value_encode(&h, NULL, "ab", out, sizeof out, &st),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "quant_group 0 for tier int2"));
    h = header_for(REMOTE_VALUE_TOKENS, POLICY_EVICT, 0, 2);
    assert_int_equal(remote_value_encode(&h, NULL, "ab", out, sizeof out, &st),
                     ST_INVALID_ARGUMENT);
    h = header_for(REMOTE_VALUE_TOKENS, POLICY_FULL, 0, 2);
    assert_int_equal(remote_value_encode(&h, NULL, NULL, out, sizeof out, &st),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(remote_value_encode(&h, NULL, "ab", NULL, 0, &st), ST_INVALID_ARGUMENT);

    /* A manifest's head changed on the wire. */
    h = header_for(REMOTE_VALUE_MANIFEST, POLICY_FULL, 0, 2);
    size_t len = remote_value_size(&h);
    assert_int_equal(remote_value_encode(&h, NULL, "{}", out, sizeof out, &st), ST_OK);
    put32le(out + 44, 1);
    reseal(out, len);
    expect_data_loss(out, len, "a manifest for layer 0 head 1");
}

/* ---- geometry ------------------------------------------------------------ */

typedef struct geometry_case {
    int id;
    void (*apply)(pool_geometry *g, uint32_t *quant_group);
    const char *msg;
} geometry_case;

static void g_layers(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->layers = 8;
}

static void g_q_heads(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->q_heads = 4;
}

static void g_kv_heads(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->kv_heads = 4;
}

static void g_head_dim(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->head_dim = 128;
}

static void g_block_tokens(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->block_tokens = 32;
}

static void g_dtype(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->dtype = POOL_BF16;
}

static void g_rope_theta(pool_geometry *g, uint32_t *q)
{
    (void)q;
    g->rope_theta = 500000.0f;
}

static void g_quant_group(pool_geometry *g, uint32_t *q)
{
    (void)g;
    *q = 64;
}

static void test_geometry_check_names_the_field(void **state)
{
    (void)state;
    remote_value_header h = header_for(REMOTE_VALUE_TOKENS, POLICY_INT4, 0, 0);
    status st;
    pool_geometry g = geom;
    assert_int_equal(remote_value_check_geometry(&h, &g, 32, &st), ST_OK);
    static const geometry_case cases[] = {
        {1, g_layers, "value written for layers 4, this pool has 8"},
        {2, g_q_heads, "value written for q_heads 8, this pool has 4"},
        {3, g_kv_heads, "value written for kv_heads 2, this pool has 4"},
        {4, g_head_dim, "value written for head_dim 64, this pool has 128"},
        {5, g_block_tokens, "value written for block_tokens 16, this pool has 32"},
        {6, g_dtype, "value written for dtype fp16, this pool has bf16"},
        {7, g_rope_theta, "value written for rope_theta 10000, this pool has 500000"},
        {8, g_quant_group, "value written for quant_group 32, this pool has 64"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        g = geom;
        uint32_t q = 32;
        cases[i].apply(&g, &q);
        st = (status){0};
        if (remote_value_check_geometry(&h, &g, q, &st) != ST_FAILED_PRECONDITION)
            fail_msg("case %d accepted", cases[i].id);
        assert_string_equal(st.msg, cases[i].msg);
    }
    /* The first field that differs is the one named. */
    g = geom;
    g.head_dim = 128;
    g.dtype = POOL_FP32;
    assert_int_equal(remote_value_check_geometry(&h, &g, 32, &st), ST_FAILED_PRECONDITION);
    assert_string_equal(st.msg, "value written for head_dim 64, this pool has 128");
    /* quant_group matters only to INT4 / INT2 values. */
    for (uint8_t t = 0; t < POLICY_TIERS; t++) {
        if (t == POLICY_EVICT)
            continue;
        uint8_t kind = t == POLICY_SKETCH ? REMOTE_VALUE_SKETCH : REMOTE_VALUE_TOKENS;
        h = header_for(kind, t, 0, 0);
        int lowbit = t == POLICY_INT4 || t == POLICY_INT2;
        assert_int_equal(remote_value_check_geometry(&h, &geom, 64, &st),
                         lowbit ? ST_FAILED_PRECONDITION : ST_OK);
        assert_int_equal(remote_value_check_geometry(&h, &geom, 32, &st), ST_OK);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_exact_strings_and_hash_tag),
        cmocka_unit_test(test_key_rejections_name_the_component),
        cmocka_unit_test(test_name_valid),
        cmocka_unit_test(test_uid_format_and_uniqueness),
        cmocka_unit_test(test_wire_layout),
        cmocka_unit_test(test_round_trips),
        cmocka_unit_test(test_every_bit_flip_is_rejected),
        cmocka_unit_test(test_every_truncation_and_trailing_bytes_rejected),
        cmocka_unit_test(test_overflowing_lengths_rejected),
        cmocka_unit_test(test_positions_must_ascend),
        cmocka_unit_test(test_fields_out_of_range),
        cmocka_unit_test(test_geometry_check_names_the_field),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
