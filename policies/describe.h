/*
 * describe.h - a growing text buffer for the policies' describe() JSON
 * (policy.h: "no JSON library"). Header-only so that each policy file can
 * use it without a shared object; every function is static inline.
 *
 * Usage: policy_text t = {0}; policy_text_add(&t, "{\"n\":%u", n); ...;
 * return policy_text_finish(&t);  -> malloc'd text (the caller of describe
 * frees it), or NULL when any add ran out of memory.
 */
#ifndef KVSTASH_POLICIES_DESCRIBE_H
#define KVSTASH_POLICIES_DESCRIBE_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct policy_text {
    char *buf;
    size_t len, cap;
    int failed; /* sticky: once set, adds do nothing and finish returns NULL */
} policy_text;

static inline void policy_text_vadd(policy_text *t, const char *fmt, va_list args)
    __attribute__((format(printf, 2, 0)));

/* Append printf-formatted text, growing the buffer (doubling) as needed. */
static inline void policy_text_vadd(policy_text *t, const char *fmt, va_list args)
{
    for (int tries = 0; !t->failed && tries < 2; tries++) {
        va_list ap;
        va_copy(ap, args);
        int n = vsnprintf(t->buf ? t->buf + t->len : NULL, t->buf ? t->cap - t->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if (t->buf != NULL && t->len + (size_t)n < t->cap) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = t->cap ? t->cap : 256;
        while (cap <= t->len + (size_t)n)
            cap *= 2;
        char *b = realloc(t->buf, cap);
        if (b == NULL) {
            t->failed = 1;
            return;
        }
        t->buf = b;
        t->cap = cap;
    }
}

static inline void policy_text_add(policy_text *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static inline void policy_text_add(policy_text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    policy_text_vadd(t, fmt, ap);
    va_end(ap);
}

/* The shortest %g text that reads back as v (15 to 17 digits). */
static inline void policy_text_double(policy_text *t, double v)
{
    char s[40];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(s, sizeof s, "%.*g", prec, v);
        if (strtod(s, NULL) == v)
            break;
    }
    policy_text_add(t, "%s", s);
}

/* The text (ownership passes to the caller), or NULL after a failure. */
static inline char *policy_text_finish(policy_text *t)
{
    if (t->failed || t->buf == NULL) {
        free(t->buf);
        t->buf = NULL;
        return NULL;
    }
    char *out = t->buf;
    t->buf = NULL;
    return out;
}

#endif
