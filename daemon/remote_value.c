#include "remote_value.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

#include "checksum.h"
#include "policy.h"

/* Wire offsets (remote_value.h). */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_HEADER_LEN = 6,
    OFF_KIND = 8,
    OFF_TIER = 9,
    OFF_DTYPE = 10,
    OFF_RESERVED = 11,
    OFF_LAYERS = 12,
    OFF_Q_HEADS = 16,
    OFF_KV_HEADS = 20,
    OFF_HEAD_DIM = 24,
    OFF_BLOCK_TOKENS = 28,
    OFF_ROPE_THETA = 32,
    OFF_QUANT_GROUP = 36,
    OFF_LAYER = 40,
    OFF_HEAD = 44,
    OFF_NTOKENS = 48,
    OFF_PAYLOAD_LEN = 52,
    OFF_CRC = 60,
};
_Static_assert(OFF_CRC + 4 == REMOTE_VALUE_HEADER_LEN, "the checksum ends the header");

static int key_char(unsigned char c, int colon);
static status_code check_component(const char *what, const char *s, size_t maxlen, int colon,
                                   status *st);
static int header_why(const remote_value_header *h, char *why, size_t n);
static void put16(uint8_t *p, uint16_t v);
static void put32(uint8_t *p, uint32_t v);
static void put64(uint8_t *p, uint64_t v);
static uint16_t get16(const uint8_t *p);
static uint32_t get32(const uint8_t *p);
static uint64_t get64(const uint8_t *p);
static uint32_t value_crc(const uint8_t *v, size_t len);

/* ---- keys ---------------------------------------------------------------- */

/* [A-Za-z0-9_.-], and ':' where colon is set (parts). Not isalnum: the
 * locale must not widen what a key may hold. */
static int key_char(unsigned char c, int colon)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-' || (colon && c == ':');
}

static status_code check_component(const char *what, const char *s, size_t maxlen, int colon,
                                   status *st)
{
    const char *allowed = colon ? "[A-Za-z0-9_.:-]" : "[A-Za-z0-9_.-]";
    if (s == NULL || s[0] == '\0')
        return status_set(st, ST_INVALID_ARGUMENT, "remote key: %s is empty", what);
    for (size_t i = 0; s[i] != '\0'; i++) {
        if (i == maxlen)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote key: %s is longer than %zu characters", what, maxlen);
        unsigned char c = (unsigned char)s[i];
        if (key_char(c, colon))
            continue;
        /* Name the character, never the whole (possibly mistaken) text. */
        if (c > 0x20 && c < 0x7f)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote key: %s has '%c' at offset %zu; only %s are allowed", what, c,
                              i, allowed);
        return status_set(st, ST_INVALID_ARGUMENT,
                          "remote key: %s has byte 0x%02x at offset %zu; only %s are allowed", what,
                          c, i, allowed);
    }
    return ST_OK;
}

status_code remote_key(char *out, size_t cap, const char *ns, const char *tenant,
                       const char *seq_uid, const char *part, status *st)
{
    if (out != NULL && cap > 0)
        out[0] = '\0';
    if (check_component("ns", ns, REMOTE_NAME_MAX, 0, st) ||
        check_component("tenant", tenant, REMOTE_NAME_MAX, 0, st) ||
        check_component("seq_uid", seq_uid, REMOTE_NAME_MAX, 0, st) ||
        check_component("part", part, REMOTE_PART_MAX, 1, st))
        return st->code;
    /* Bounded above by REMOTE_KEY_CAP - 1: no overflow. */
    size_t need = strlen("kvs:") + strlen(ns) + strlen(":{") + strlen(tenant) + 1 +
                  strlen(seq_uid) + strlen("}:") + strlen(part) + 1;
    if (out == NULL || cap < need)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "remote key: needs %zu bytes, the buffer has %zu", need,
                          out == NULL ? (size_t)0 : cap);
    snprintf(out, cap, "kvs:%s:{%s:%s}:%s", ns, tenant, seq_uid, part);
    return ST_OK;
}

int remote_name_valid(const char *s, size_t maxlen)
{
    if (s == NULL || s[0] == '\0')
        return 0;
    for (size_t i = 0; s[i] != '\0'; i++)
        if (i == maxlen || !key_char((unsigned char)s[i], 0))
            return 0;
    return 1;
}

status_code remote_uid_new(char out[REMOTE_UID_LEN + 1], status *st)
{
    static const char hex[] = "0123456789abcdef";
    uint8_t raw[REMOTE_UID_LEN / 2];
    size_t got = 0;
    out[0] = '\0';
    while (got < sizeof raw) {
        ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return status_set(st, ST_INTERNAL, "remote uid: getrandom failed: %s",
                              n < 0 ? strerror(errno) : "no bytes");
        got += (size_t)n;
    }
    for (size_t i = 0; i < sizeof raw; i++) {
        out[2 * i] = hex[raw[i] >> 4];
        out[2 * i + 1] = hex[raw[i] & 15];
    }
    out[REMOTE_UID_LEN] = '\0';
    return ST_OK;
}

/* ---- values -------------------------------------------------------------- */

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static uint32_t get32(const uint8_t *p)
{
    return remote_value_position(p, 0);
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* CRC-32 of v[0..len) with the checksum field as zeros; len >= the header. */
static uint32_t value_crc(const uint8_t *v, size_t len)
{
    static const uint8_t zero[4];
    uint32_t c = checksum_crc32(0, v, OFF_CRC);
    c = checksum_crc32(c, zero, sizeof zero);
    return checksum_crc32(c, v + REMOTE_VALUE_HEADER_LEN, len - REMOTE_VALUE_HEADER_LEN);
}

/* The constraints of remote_value.h on a header's fields: 0, or -1 with
 * what is wrong in why. Shared by encode and decode, so that everything
 * encode writes decodes and the other way round. */
static int header_why(const remote_value_header *h, char *why, size_t n)
{
    if (h->kind < REMOTE_VALUE_TOKENS || h->kind > REMOTE_VALUE_MANIFEST) {
        snprintf(why, n, "kind %u is not 1 (tokens), 2 (sketch) or 3 (manifest)", h->kind);
        return -1;
    }
    if (h->tier >= POLICY_TIERS || h->tier == POLICY_EVICT) {
        snprintf(why, n, "tier %u is not a stored tier", h->tier);
        return -1;
    }
    int ok = h->kind == REMOTE_VALUE_TOKENS   ? h->tier != POLICY_SKETCH
             : h->kind == REMOTE_VALUE_SKETCH ? h->tier == POLICY_SKETCH
                                              : h->tier == POLICY_FULL;
    if (!ok) {
        static const char *const kinds[] = {"?", "tokens", "sketch", "manifest"};
        snprintf(why, n, "tier %s in a %s value", policy_tier_name(h->tier), kinds[h->kind]);
        return -1;
    }
    if (h->dtype != POOL_FP16 && h->dtype != POOL_BF16 && h->dtype != POOL_FP32) {
        snprintf(why, n, "dtype %u is not 1 (fp16), 2 (bf16) or 3 (fp32)", h->dtype);
        return -1;
    }
    const struct {
        const char *name;
        uint32_t v;
    } dims[] = {{"layers", h->layers},
                {"q_heads", h->q_heads},
                {"kv_heads", h->kv_heads},
                {"head_dim", h->head_dim},
                {"block_tokens", h->block_tokens}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v == 0) {
            snprintf(why, n, "%s is 0", dims[i].name);
            return -1;
        }
    if (!isfinite(h->rope_theta) || !(h->rope_theta > 0)) {
        snprintf(why, n, "rope_theta %g is not a positive number", (double)h->rope_theta);
        return -1;
    }
    int lowbit = h->tier == POLICY_INT4 || h->tier == POLICY_INT2;
    if (lowbit ? h->quant_group == 0 : h->quant_group != 0) {
        snprintf(why, n, "quant_group %u for tier %s (want %s)", h->quant_group,
                 policy_tier_name(h->tier), lowbit ? ">= 1" : "0");
        return -1;
    }
    if (h->kind == REMOTE_VALUE_MANIFEST && (h->layer != 0 || h->head != 0)) {
        snprintf(why, n, "a manifest for layer %u head %u (want 0, 0)", h->layer, h->head);
        return -1;
    }
    if (h->layer >= h->layers) {
        snprintf(why, n, "layer %u of %u layers", h->layer, h->layers);
        return -1;
    }
    if (h->head >= h->kv_heads) {
        snprintf(why, n, "head %u of %u kv_heads", h->head, h->kv_heads);
        return -1;
    }
    return 0;
}

size_t remote_value_payload_offset(const remote_value_header *h)
{
    /* ntokens is a u32: 4 * ntokens fits a u64. */
    uint64_t off = REMOTE_VALUE_HEADER_LEN + 4 * (uint64_t)h->ntokens;
    return off > SIZE_MAX ? SIZE_MAX : (size_t)off;
}

size_t remote_value_size(const remote_value_header *h)
{
    size_t off = remote_value_payload_offset(h);
    if (off == SIZE_MAX || h->payload_len >= (uint64_t)(SIZE_MAX - off))
        return SIZE_MAX;
    return off + (size_t)h->payload_len;
}

status_code remote_value_encode(const remote_value_header *h, const uint32_t *positions,
                                const void *payload, void *out, size_t cap, status *st)
{
    char why[160];
    if (header_why(h, why, sizeof why))
        return status_set(st, ST_INVALID_ARGUMENT, "remote value: %s", why);
    if (h->ntokens > 0 && positions == NULL)
        return status_set(st, ST_INVALID_ARGUMENT, "remote value: %u positions but no array",
                          h->ntokens);
    if (h->payload_len > 0 && payload == NULL)
        return status_set(st, ST_INVALID_ARGUMENT, "remote value: %llu payload bytes but no buffer",
                          (unsigned long long)h->payload_len);
    for (uint32_t i = 1; i < h->ntokens; i++)
        if (positions[i] <= positions[i - 1])
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote value: position %u (%u) does not follow %u: positions must "
                              "be strictly ascending",
                              i, positions[i], positions[i - 1]);
    size_t size = remote_value_size(h);
    if (size == SIZE_MAX)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "remote value: %u positions and %llu payload bytes overflow size_t",
                          h->ntokens, (unsigned long long)h->payload_len);
    if (out == NULL || cap < size)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "remote value: needs %zu bytes, the buffer has %zu", size,
                          out == NULL ? (size_t)0 : cap);

    uint8_t *v = out;
    size_t off = remote_value_payload_offset(h);
    /* The payload first: it may lie in out already, at off (memmove allows
     * the exact overlap), and nothing below writes past off. */
    if (h->payload_len > 0)
        memmove(v + off, payload, (size_t)h->payload_len);
    memcpy(v + OFF_MAGIC, REMOTE_VALUE_MAGIC, 4);
    put16(v + OFF_VERSION, REMOTE_VALUE_VERSION);
    put16(v + OFF_HEADER_LEN, REMOTE_VALUE_HEADER_LEN);
    v[OFF_KIND] = h->kind;
    v[OFF_TIER] = h->tier;
    v[OFF_DTYPE] = h->dtype;
    v[OFF_RESERVED] = 0;
    put32(v + OFF_LAYERS, h->layers);
    put32(v + OFF_Q_HEADS, h->q_heads);
    put32(v + OFF_KV_HEADS, h->kv_heads);
    put32(v + OFF_HEAD_DIM, h->head_dim);
    put32(v + OFF_BLOCK_TOKENS, h->block_tokens);
    uint32_t theta;
    memcpy(&theta, &h->rope_theta, sizeof theta);
    put32(v + OFF_ROPE_THETA, theta);
    put32(v + OFF_QUANT_GROUP, h->quant_group);
    put32(v + OFF_LAYER, h->layer);
    put32(v + OFF_HEAD, h->head);
    put32(v + OFF_NTOKENS, h->ntokens);
    put64(v + OFF_PAYLOAD_LEN, h->payload_len);
    for (uint32_t i = 0; i < h->ntokens; i++)
        put32(v + REMOTE_VALUE_HEADER_LEN + 4 * (size_t)i, positions[i]);
    put32(v + OFF_CRC, value_crc(v, size));
    return ST_OK;
}

status_code remote_value_decode(const void *buf, size_t len, remote_value_header *h,
                                const uint8_t **positions_le, const uint8_t **payload, status *st)
{
    const uint8_t *v = buf;
    if (len < 4 || memcmp(v + OFF_MAGIC, REMOTE_VALUE_MAGIC, 4) != 0)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: no \"KVSR\" magic (%zu bytes, not a kvstash value)", len);
    if (len < OFF_HEADER_LEN + 2)
        return status_set(st, ST_DATA_LOSS, "remote value: truncated at %zu bytes, in the header",
                          len);
    unsigned version = get16(v + OFF_VERSION), hlen = get16(v + OFF_HEADER_LEN);
    if (version != REMOTE_VALUE_VERSION)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: format version %u, this kvstashd reads version %d",
                          version, REMOTE_VALUE_VERSION);
    if (hlen != REMOTE_VALUE_HEADER_LEN)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: header length %u, version %d has %d bytes", hlen,
                          REMOTE_VALUE_VERSION, REMOTE_VALUE_HEADER_LEN);
    if (len < REMOTE_VALUE_HEADER_LEN)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: truncated at %zu bytes, in the %d-byte header", len,
                          REMOTE_VALUE_HEADER_LEN);

    remote_value_header d = {
        .kind = v[OFF_KIND],
        .tier = v[OFF_TIER],
        .dtype = v[OFF_DTYPE],
        .layers = get32(v + OFF_LAYERS),
        .q_heads = get32(v + OFF_Q_HEADS),
        .kv_heads = get32(v + OFF_KV_HEADS),
        .head_dim = get32(v + OFF_HEAD_DIM),
        .block_tokens = get32(v + OFF_BLOCK_TOKENS),
        .quant_group = get32(v + OFF_QUANT_GROUP),
        .layer = get32(v + OFF_LAYER),
        .head = get32(v + OFF_HEAD),
        .ntokens = get32(v + OFF_NTOKENS),
        .payload_len = get64(v + OFF_PAYLOAD_LEN),
    };
    uint32_t theta = get32(v + OFF_ROPE_THETA);
    memcpy(&d.rope_theta, &theta, sizeof theta);

    /* The lengths before anything beyond the header is read. */
    size_t size = remote_value_size(&d);
    if (size == SIZE_MAX)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: header lengths overflow (%u positions, %llu payload "
                          "bytes)",
                          d.ntokens, (unsigned long long)d.payload_len);
    if (size != len)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: %zu bytes, its header says %zu (%u positions, %llu "
                          "payload bytes): %s",
                          len, size, d.ntokens, (unsigned long long)d.payload_len,
                          len < size ? "truncated" : "trailing bytes");
    uint32_t stored = get32(v + OFF_CRC), computed = value_crc(v, len);
    if (stored != computed)
        return status_set(st, ST_DATA_LOSS,
                          "remote value: checksum mismatch (stored 0x%08x, computed 0x%08x)",
                          stored, computed);

    /* Bytes as written: what is wrong now is the writer's. */
    char why[160];
    if (v[OFF_RESERVED] != 0)
        return status_set(st, ST_DATA_LOSS, "remote value: reserved byte is 0x%02x, not 0",
                          v[OFF_RESERVED]);
    if (header_why(&d, why, sizeof why))
        return status_set(st, ST_DATA_LOSS, "remote value: %s", why);
    const uint8_t *pos = v + REMOTE_VALUE_HEADER_LEN;
    for (uint32_t i = 1; i < d.ntokens; i++) {
        uint32_t a = remote_value_position(pos, i - 1), b = remote_value_position(pos, i);
        if (b <= a)
            return status_set(st, ST_DATA_LOSS,
                              "remote value: position %u (%u) does not follow %u: positions are "
                              "not strictly ascending",
                              i, b, a);
    }
    *h = d;
    if (positions_le != NULL)
        *positions_le = pos;
    if (payload != NULL)
        *payload = v + remote_value_payload_offset(&d);
    return ST_OK;
}

status_code remote_value_check_geometry(const remote_value_header *h, const pool_geometry *g,
                                        uint32_t quant_group, status *st)
{
    static const char *const dtypes[] = {"?", "fp16", "bf16", "fp32"};
    const struct {
        const char *name;
        uint32_t value, pool;
    } dims[] = {{"layers", h->layers, g->layers},
                {"q_heads", h->q_heads, g->q_heads},
                {"kv_heads", h->kv_heads, g->kv_heads},
                {"head_dim", h->head_dim, g->head_dim},
                {"block_tokens", h->block_tokens, g->block_tokens}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].value != dims[i].pool)
            return status_set(st, ST_FAILED_PRECONDITION,
                              "value written for %s %u, this pool has %u", dims[i].name,
                              dims[i].value, dims[i].pool);
    if (h->dtype != (unsigned)g->dtype)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "value written for dtype %s, this pool has %s",
                          dtypes[h->dtype <= POOL_FP32 ? h->dtype : 0],
                          dtypes[(unsigned)g->dtype <= POOL_FP32 ? (unsigned)g->dtype : 0]);
    if (h->rope_theta != g->rope_theta)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "value written for rope_theta %g, this pool has %g",
                          (double)h->rope_theta, (double)g->rope_theta);
    if ((h->tier == POLICY_INT4 || h->tier == POLICY_INT2) && h->quant_group != quant_group)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "value written for quant_group %u, this pool has %u", h->quant_group,
                          quant_group);
    return ST_OK;
}
