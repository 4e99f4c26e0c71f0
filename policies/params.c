/*
 * params.c - validating a client's key=value parameters against a policy's
 * spec (policy.h "policy_params_resolve") and parsing them strictly.
 *
 * Every message names the parameter and the policy, so that a client who
 * typed `windw=8` learns which keys exist instead of getting a bare
 * INVALID_ARGUMENT. Client text is echoed at most 64 bytes long so that the
 * useful part of the message survives truncation to POLICY_ERR_LEN.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "policy.h"
#include "storage.h"
#include "util.h"

#define VALUE_MAX (sizeof(((policy_params *)0)->value[0]) - 1) /* 63 bytes + NUL */

/* Index of `key` in the policy's spec followed by the storage keys every
 * policy accepts (storage.h), or -1. */
static long spec_index(const policy_ops *ops, const char *key)
{
    for (size_t i = 0; i < ops->nparams; i++) {
        if (strcmp(ops->params[i].key, key) == 0)
            return (long)i;
    }
    size_t ns;
    const policy_param_spec *st = policy_storage_spec(&ns);
    for (size_t i = 0; i < ns; i++) {
        if (strcmp(st[i].key, key) == 0)
            return (long)(ops->nparams + i);
    }
    return -1;
}

/* "n_sink, window" (or "none"), truncated to fit buf. */
static void known_keys(const policy_ops *ops, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < ops->nparams && used < len; i++) {
        int n = snprintf(buf + used, len - used, "%s%s", i ? ", " : "", ops->params[i].key);
        if (n < 0)
            break;
        used += (size_t)n;
    }
    if (used < len)
        snprintf(buf + used, len - used, "%sand the storage keys demote, int8, victims, sketch_*",
                 ops->nparams ? "; " : "");
}

/* Checks one client pair: known key, not seen before, value fits. */
static int check_pair(const policy_ops *ops, const char *const *keys, const char *const *values,
                      size_t i, char *err, size_t errlen)
{
    const char *key = keys[i];
    if (key == NULL || key[0] == '\0') {
        policy_set_err(err, errlen, "empty parameter name for policy '%s'", ops->name);
        return -1;
    }
    if (spec_index(ops, key) < 0) {
        char known[POLICY_ERR_LEN];
        known_keys(ops, known, sizeof(known));
        policy_set_err(err, errlen, "unknown parameter '%.64s' for policy '%s' (known: %s)", key,
                       ops->name, known);
        return -1;
    }
    for (size_t j = 0; j < i; j++) {
        if (strcmp(keys[j], key) == 0) {
            policy_set_err(err, errlen, "duplicate parameter '%s' for policy '%s'", key, ops->name);
            return -1;
        }
    }
    if (values[i] == NULL) {
        policy_set_err(err, errlen, "parameter '%s' for policy '%s' has no value", key, ops->name);
        return -1;
    }
    if (strnlen(values[i], VALUE_MAX + 1) > VALUE_MAX) {
        policy_set_err(err, errlen,
                       "value of parameter '%s' for policy '%s' is longer than %zu bytes", key,
                       ops->name, VALUE_MAX);
        return -1;
    }
    return 0;
}

int policy_params_resolve(const policy_ops *ops, const char *const *keys, const char *const *values,
                          size_t n, policy_params *out, char *err, size_t errlen)
{
    if (ops == NULL || out == NULL || (n > 0 && (keys == NULL || values == NULL))) {
        policy_set_err(err, errlen, "invalid arguments to policy_params_resolve");
        return -1;
    }
    size_t nstorage;
    const policy_param_spec *storage = policy_storage_spec(&nstorage);
    if (ops->nparams + nstorage > POLICY_MAX_PARAMS) {
        policy_set_err(err, errlen, "policy '%s' declares %zu parameters, at most %zu supported",
                       ops->name, ops->nparams, POLICY_MAX_PARAMS - nstorage);
        return -1;
    }
    /* Validate everything before writing *out, so a rejected set changes nothing. */
    for (size_t i = 0; i < n; i++) {
        if (check_pair(ops, keys, values, i, err, errlen) != 0)
            return -1;
    }
    for (size_t i = 0; i < ops->nparams; i++) {
        if (strlen(ops->params[i].def) > VALUE_MAX) {
            policy_set_err(err, errlen, "default of parameter '%s' for policy '%s' is too long",
                           ops->params[i].key, ops->name);
            return -1;
        }
    }

    memset(out, 0, sizeof(*out));
    out->count = ops->nparams + nstorage;
    for (size_t i = 0; i < out->count; i++) {
        const policy_param_spec *sp =
            i < ops->nparams ? &ops->params[i] : &storage[i - ops->nparams];
        out->key[i] = sp->key;
        strcpy(out->value[i], sp->def);
    }
    for (size_t i = 0; i < n; i++)
        strcpy(out->value[spec_index(ops, keys[i])], values[i]);
    return 0;
}

const char *policy_params_get(const policy_params *p, const char *key)
{
    if (p == NULL || key == NULL)
        return NULL;
    for (size_t i = 0; i < p->count && i < POLICY_MAX_PARAMS; i++) {
        if (p->key[i] != NULL && strcmp(p->key[i], key) == 0)
            return p->value[i];
    }
    return NULL;
}

/* Decimal digits only: no sign, no space, no trailing text, no overflow. */
static int parse_decimal(const char *s, uint64_t limit, uint64_t *out)
{
    uint64_t v = 0;
    if (*s == '\0')
        return -1;
    for (; *s != '\0'; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        v = v * 10 + (uint64_t)(*s - '0');
        if (v > limit)
            return -1; /* out of range: stop before uint64_t could wrap */
    }
    *out = v;
    return 0;
}

int policy_params_uint(const policy_params *p, const char *key, uint32_t min, uint32_t max,
                       uint32_t *out, char *err, size_t errlen)
{
    const char *s = policy_params_get(p, key);
    if (s == NULL) {
        policy_set_err(err, errlen, "no parameter %s in this policy", key ? key : "(null)");
        return -1;
    }
    uint64_t v;
    if (parse_decimal(s, max, &v) != 0 || v < min) {
        policy_set_err(err, errlen,
                       "parameter %s must be an integer in [%" PRIu32 ", %" PRIu32 "], got '%s'",
                       key, min, max, s);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

int policy_params_double(const policy_params *p, const char *key, double min, double max,
                         double *out, char *err, size_t errlen)
{
    const char *s = policy_params_get(p, key);
    if (s == NULL) {
        policy_set_err(err, errlen, "no parameter %s in this policy", key ? key : "(null)");
        return -1;
    }
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    /* isfinite() rejects "nan" and "inf", which strtod accepts; strtod also
     * skips leading white space, which the integers refuse too. */
    if (*s == '\0' || isspace((unsigned char)*s) || *end != '\0' || errno != 0 || !isfinite(v) ||
        v < min || v > max) {
        policy_set_err(err, errlen, "parameter %s must be a number in [%g, %g], got '%s'", key, min,
                       max, s);
        return -1;
    }
    *out = v;
    return 0;
}

int policy_params_choice(const policy_params *p, const char *key, const char *const *choices,
                         unsigned *out, char *err, size_t errlen)
{
    const char *s = policy_params_get(p, key);
    if (s == NULL) {
        policy_set_err(err, errlen, "no parameter %s in this policy", key ? key : "(null)");
        return -1;
    }
    char list[160] = "";
    for (unsigned i = 0; choices[i] != NULL; i++) {
        if (strcmp(s, choices[i]) == 0) {
            *out = i;
            return 0;
        }
        size_t n = strlen(list);
        snprintf(list + n, sizeof list - n, "%s%s", i ? ", " : "", choices[i]);
    }
    policy_set_err(err, errlen, "parameter %s must be one of %s, got '%s'", key, list, s);
    return -1;
}

/* One UINT entry, with its optional word. */
static int parse_uint_entry(const policy_params *p, const policy_param_spec *sp, uint32_t *out,
                            char *err, size_t errlen)
{
    const char *s = policy_params_get(p, sp->key);
    if (sp->word != NULL && s != NULL && strcmp(s, sp->word) == 0) {
        *out = sp->word_value;
        return 0;
    }
    uint32_t lo = (uint32_t)sp->min, hi = (uint32_t)sp->max;
    if (policy_params_uint(p, sp->key, lo, hi, out, err, errlen) == 0)
        return 0;
    if (sp->word != NULL && sp->word[0] != '\0' && s != NULL)
        policy_set_err(err, errlen,
                       "parameter %s must be '%s' or an integer in [%" PRIu32 ", %" PRIu32
                       "], got '%s'",
                       sp->key, sp->word, lo, hi, s);
    return -1;
}

int policy_params_parse(const policy_params *p, const policy_param_spec *spec, size_t n,
                        void *config, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++) {
        const policy_param_spec *sp = &spec[i];
        void *field = (char *)config + sp->offset;
        int rc = 0;
        switch (sp->type) {
        case POLICY_PARAM_TEXT:
            break;
        case POLICY_PARAM_UINT:
            rc = parse_uint_entry(p, sp, field, err, errlen);
            break;
        case POLICY_PARAM_DOUBLE:
            rc = policy_params_double(p, sp->key, sp->min, sp->max, field, err, errlen);
            break;
        case POLICY_PARAM_CHOICE:
            rc = policy_params_choice(p, sp->key, sp->choices, field, err, errlen);
            break;
        }
        if (rc != 0)
            return -1;
    }
    return 0;
}
