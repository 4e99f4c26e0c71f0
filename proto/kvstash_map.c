/* kvstash_map.c - the fd socket's MAP answer; see kvstash_map.h. */
#include "kvstash_map.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char hexdigits[] = "0123456789abcdef";

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int kvstash_map_has_fd(kvstash_map_kind kind)
{
    return kind == KVSTASH_MAP_MEMFD || kind == KVSTASH_MAP_CUDA_VMM;
}

const char *kvstash_map_kind_name(kvstash_map_kind kind)
{
    switch (kind) {
    case KVSTASH_MAP_MEMFD:
        return "memfd";
    case KVSTASH_MAP_CUDA_VMM:
        return "vmm";
    case KVSTASH_MAP_CUDA_LEGACY:
        return "legacy";
    }
    return "?";
}

void kvstash_gpu_uuid_format(const uint8_t uuid[KVSTASH_GPU_UUID_BYTES],
                             char out[KVSTASH_GPU_UUID_TEXT])
{
    char *p = out;
    memcpy(p, "GPU-", 4);
    p += 4;
    for (int i = 0; i < KVSTASH_GPU_UUID_BYTES; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            *p++ = '-';
        *p++ = hexdigits[uuid[i] >> 4];
        *p++ = hexdigits[uuid[i] & 15];
    }
    *p = '\0';
}

/* Read the UUID at the start of text; returns the characters read (40),
 * or 0 when it is not one. */
static size_t uuid_read(const char *text, uint8_t uuid[KVSTASH_GPU_UUID_BYTES])
{
    if (strncmp(text, "GPU-", 4) != 0)
        return 0;
    const char *p = text + 4;
    for (int i = 0; i < KVSTASH_GPU_UUID_BYTES; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) {
            if (*p != '-')
                return 0;
            p++;
        }
        int hi = hex_value(p[0]), lo = hi < 0 ? -1 : hex_value(p[1]);
        if (lo < 0)
            return 0;
        uuid[i] = (uint8_t)(hi << 4 | lo);
        p += 2;
    }
    return (size_t)(p - text);
}

int kvstash_gpu_uuid_parse(const char *text, uint8_t uuid[KVSTASH_GPU_UUID_BYTES])
{
    uint8_t tmp[KVSTASH_GPU_UUID_BYTES];
    size_t n = uuid_read(text, tmp);
    if (n == 0 || text[n] != '\0')
        return -1;
    memcpy(uuid, tmp, sizeof tmp);
    return 0;
}

int kvstash_map_format(const kvstash_map_answer *a, char *buf, size_t len)
{
    char uuid[KVSTASH_GPU_UUID_TEXT];
    int n;
    switch (a->kind) {
    case KVSTASH_MAP_MEMFD:
        n = snprintf(buf, len, "OK %" PRIu64, a->bytes);
        break;
    case KVSTASH_MAP_CUDA_VMM:
        kvstash_gpu_uuid_format(a->gpu_uuid, uuid);
        n = snprintf(buf, len, "OK %" PRIu64 " cuda vmm %s", a->bytes, uuid);
        break;
    case KVSTASH_MAP_CUDA_LEGACY: {
        char hex[2 * KVSTASH_MAP_HANDLE_BYTES + 1];
        for (int i = 0; i < KVSTASH_MAP_HANDLE_BYTES; i++) {
            hex[2 * i] = hexdigits[a->legacy_handle[i] >> 4];
            hex[2 * i + 1] = hexdigits[a->legacy_handle[i] & 15];
        }
        hex[sizeof hex - 1] = '\0';
        kvstash_gpu_uuid_format(a->gpu_uuid, uuid);
        n = snprintf(buf, len, "OK %" PRIu64 " cuda legacy %s %s", a->bytes, uuid, hex);
        break;
    }
    default:
        return -1;
    }
    return n < 0 || (size_t)n >= len ? -1 : n;
}

/* The next word of *p (up to a space or the end) into word[cap]; the
 * separating space is consumed. 0, or -1 when there is none or it is too
 * long. */
static int next_word(const char **p, char *word, size_t cap)
{
    const char *s = *p;
    size_t n = strcspn(s, " ");
    if (n == 0 || n >= cap)
        return -1;
    memcpy(word, s, n);
    word[n] = '\0';
    s += n;
    if (*s == ' ')
        s++;
    *p = s;
    return 0;
}

__attribute__((format(printf, 3, 4))) static int bad(char *err, size_t errlen, const char *fmt, ...)
{
    if (err != NULL && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int kvstash_map_parse(const char *text, kvstash_map_answer *a, char *err, size_t errlen)
{
    kvstash_map_answer out;
    memset(&out, 0, sizeof out);
    if (strncmp(text, "OK ", 3) != 0)
        return bad(err, errlen, "the answer does not start with \"OK \": \"%.64s\"", text);
    size_t len = strlen(text);
    if (strstr(text, "  ") != NULL || text[len - 1] == ' ')
        return bad(err, errlen, "stray spaces in the answer \"%.64s\"", text);
    const char *p = text + 3;
    char word[2 * KVSTASH_MAP_HANDLE_BYTES + 2];
    if (next_word(&p, word, sizeof word) != 0)
        return bad(err, errlen, "the answer names no size: \"%.64s\"", text);
    uint64_t bytes = 0;
    for (const char *d = word; *d; d++) {
        if (*d < '0' || *d > '9')
            return bad(err, errlen, "the size \"%.24s\" is not a decimal number", word);
        if (bytes > (UINT64_MAX - (uint64_t)(*d - '0')) / 10)
            return bad(err, errlen, "the size \"%.24s\" is out of range", word);
        bytes = bytes * 10 + (uint64_t)(*d - '0');
    }
    out.bytes = bytes;
    if (*p == '\0') {
        out.kind = KVSTASH_MAP_MEMFD;
        *a = out;
        return 0;
    }
    if (next_word(&p, word, sizeof word) != 0 || strcmp(word, "cuda") != 0)
        return bad(err, errlen,
                   "unknown memory kind in \"%.80s\" (this libkvstash knows host memory and "
                   "\"cuda\")",
                   text);
    if (next_word(&p, word, sizeof word) != 0)
        return bad(err, errlen, "the answer names no CUDA IPC kind: \"%.80s\"", text);
    if (strcmp(word, "vmm") == 0)
        out.kind = KVSTASH_MAP_CUDA_VMM;
    else if (strcmp(word, "legacy") == 0)
        out.kind = KVSTASH_MAP_CUDA_LEGACY;
    else
        return bad(err, errlen, "unknown CUDA IPC kind \"%.16s\" (expected vmm or legacy)", word);
    if (next_word(&p, word, sizeof word) != 0 || kvstash_gpu_uuid_parse(word, out.gpu_uuid) != 0)
        return bad(err, errlen, "malformed GPU UUID in \"%.120s\" (expected GPU-xxxxxxxx-...)",
                   text);
    if (out.kind == KVSTASH_MAP_CUDA_VMM) {
        if (*p != '\0')
            return bad(err, errlen, "unexpected text after the GPU UUID: \"%.40s\"", p);
        *a = out;
        return 0;
    }
    if (next_word(&p, word, sizeof word) != 0 || strlen(word) != 2 * KVSTASH_MAP_HANDLE_BYTES)
        return bad(err, errlen, "the legacy IPC handle must be %d hex digits",
                   2 * KVSTASH_MAP_HANDLE_BYTES);
    for (int i = 0; i < KVSTASH_MAP_HANDLE_BYTES; i++) {
        int hi = hex_value(word[2 * i]), lo = hex_value(word[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return bad(err, errlen, "the legacy IPC handle has a non-hex digit at %d",
                       hi < 0 ? 2 * i : 2 * i + 1);
        out.legacy_handle[i] = (uint8_t)(hi << 4 | lo);
    }
    if (*p != '\0')
        return bad(err, errlen, "unexpected text after the legacy IPC handle: \"%.40s\"", p);
    *a = out;
    return 0;
}
