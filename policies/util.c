#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void policy_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static int evict_before(const double *s, uint32_t x, uint32_t y, int ties_to_lower)
{
    return s[x] < s[y] || (s[x] == s[y] && (ties_to_lower ? x < y : x > y));
}

/* Sift a[i] down a max-heap whose top is the entry evicted LAST. */
static void sift_down(uint32_t *a, uint32_t n, uint32_t i, const double *s, int low)
{
    for (;;) {
        uint32_t top = i, l = 2 * i + 1, r = 2 * i + 2;
        if (l < n && evict_before(s, a[top], a[l], low))
            top = l;
        if (r < n && evict_before(s, a[top], a[r], low))
            top = r;
        if (top == i)
            return;
        uint32_t t = a[i];
        a[i] = a[top];
        a[top] = t;
        i = top;
    }
}

void policy_select_evict_first(uint32_t *a, uint32_t m, uint32_t k, const double *s,
                               int ties_to_lower)
{
    if (k == 0)
        return;
    for (uint32_t i = k / 2; i-- > 0;)
        sift_down(a, k, i, s, ties_to_lower);
    for (uint32_t i = k; i < m; i++)
        if (evict_before(s, a[i], a[0], ties_to_lower)) {
            a[0] = a[i];
            sift_down(a, k, 0, s, ties_to_lower);
        }
}

void *policy_array_copy(const void *src, size_t used, size_t room, size_t size)
{
    size_t bytes = room * size;
    void *a = malloc(bytes ? bytes : 1);
    if (a != NULL && used > 0)
        memcpy(a, src, used * size);
    return a;
}
