/*
 * tokenizer.c - the llama2.c tokenizer (tokenizer.h), after run.c's
 * encode()/decode() (Karpathy, 2023), which mirror sentencepiece BPE with
 * byte fallback.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

typedef struct piece_index {
    const char *str;
    uint32_t id;
} piece_index;

struct tokenizer {
    uint32_t vocab, max_len;
    char **pieces;
    float *scores;
    piece_index *sorted; /* pieces by strcmp, for lookups */
    char byte_piece[2];  /* tok_decode's answer for byte tokens */
};

static int cmp_piece(const void *a, const void *b)
{
    return strcmp(((const piece_index *)a)->str, ((const piece_index *)b)->str);
}

/* The id of `s`, or -1. */
static long lookup(const tokenizer *t, const char *s)
{
    piece_index key = {s, 0};
    const piece_index *hit = bsearch(&key, t->sorted, t->vocab, sizeof key, cmp_piece);
    return hit ? (long)hit->id : -1;
}

void tok_free(tokenizer *t)
{
    if (t == NULL)
        return;
    for (uint32_t i = 0; t->pieces != NULL && i < t->vocab; i++)
        free(t->pieces[i]);
    free(t->pieces);
    free(t->scores);
    free(t->sorted);
    free(t);
}

tokenizer *tok_load(const char *path, uint32_t vocab, char *err, size_t errlen)
{
    tokenizer *t = calloc(1, sizeof *t);
    FILE *f = fopen(path, "rb");
    int32_t max_len;
    if (t == NULL || f == NULL) {
        snprintf(err, errlen, "cannot open %s", path);
        goto fail;
    }
    t->vocab = vocab;
    t->pieces = calloc(vocab, sizeof *t->pieces);
    t->scores = calloc(vocab, sizeof *t->scores);
    t->sorted = calloc(vocab, sizeof *t->sorted);
    if (!t->pieces || !t->scores || !t->sorted) {
        snprintf(err, errlen, "out of memory for %u pieces", vocab);
        goto fail;
    }
    if (fread(&max_len, 4, 1, f) != 1 || max_len <= 0 || max_len > 4096) {
        snprintf(err, errlen, "%s: bad header (max_token_length)", path);
        goto fail;
    }
    t->max_len = (uint32_t)max_len;
    for (uint32_t i = 0; i < vocab; i++) {
        int32_t len;
        if (fread(&t->scores[i], 4, 1, f) != 1 || fread(&len, 4, 1, f) != 1 || len < 0 ||
            len > 4096) {
            snprintf(err, errlen, "%s: piece %u: truncated or bad length (model vocab %u)", path, i,
                     vocab);
            goto fail;
        }
        t->pieces[i] = malloc((size_t)len + 1);
        if (t->pieces[i] == NULL || fread(t->pieces[i], 1, (size_t)len, f) != (size_t)len) {
            snprintf(err, errlen, "%s: piece %u truncated", path, i);
            goto fail;
        }
        t->pieces[i][len] = '\0';
        t->sorted[i] = (piece_index){t->pieces[i], i};
    }
    fclose(f);
    qsort(t->sorted, vocab, sizeof *t->sorted, cmp_piece);
    return t;
fail:
    if (f != NULL)
        fclose(f);
    tok_free(t);
    return NULL;
}

uint32_t tok_vocab(const tokenizer *t)
{
    return t->vocab;
}

/* Split text into code points (or bytes when a code point has no piece). */
static size_t encode_chars(const tokenizer *t, const char *text, uint32_t *ids, size_t n)
{
    char buf[8];
    size_t len = 0;
    for (const char *c = text; *c != '\0'; c++) {
        /* A new code point starts at a byte that is not 10xxxxxx. */
        if ((*c & 0xC0) != 0x80)
            len = 0;
        buf[len++] = *c;
        buf[len] = '\0';
        if ((c[1] & 0xC0) == 0x80 && len < 4)
            continue;
        long id = lookup(t, buf);
        if (id >= 0) {
            ids[n++] = (uint32_t)id;
        } else { /* byte fallback: the first 3 ids are <unk>, <s>, </s> */
            for (size_t i = 0; i < len; i++)
                ids[n++] = (uint8_t)buf[i] + 3u;
        }
        len = 0;
    }
    return n;
}

/* The id of the merge of pieces a and b, or -1. */
static long pair_id(const tokenizer *t, char *buf, size_t cap, uint32_t a, uint32_t b)
{
    snprintf(buf, cap, "%s%s", t->pieces[a], t->pieces[b]);
    return lookup(t, buf);
}

long tok_encode(const tokenizer *t, const char *text, int bos, uint32_t *ids)
{
    size_t cap = (size_t)t->max_len * 2 + 3, len = strlen(text) + 2;
    char *buf = malloc(cap);
    long *pair = malloc(len * sizeof *pair); /* pair[i]: merge of ids[i], ids[i+1] */
    if (buf == NULL || pair == NULL) {
        free(buf);
        free(pair);
        return -1;
    }
    size_t n = 0;
    if (bos)
        ids[n++] = TOK_BOS;
    size_t first = n;
    if (text[0] != '\0') {
        long sp = lookup(t, " ");
        ids[n++] = sp >= 0 ? (uint32_t)sp : ' ' + 3u;
    }
    n = encode_chars(t, text, ids, n);
    for (size_t i = first; i + 1 < n; i++)
        pair[i] = pair_id(t, buf, cap, ids[i], ids[i + 1]);
    /* Merge the best-scoring adjacent pair (the first on ties) until no pair
     * is in the vocabulary; only the merged pair's neighbours change. */
    for (;;) {
        float best = -1e10f;
        long best_id = -1;
        size_t at = 0;
        for (size_t i = first; i + 1 < n; i++)
            if (pair[i] >= 0 && t->scores[pair[i]] > best) {
                best = t->scores[pair[i]];
                best_id = pair[i];
                at = i;
            }
        if (best_id < 0)
            break;
        ids[at] = (uint32_t)best_id;
        memmove(ids + at + 1, ids + at + 2, (n - at - 2) * sizeof *ids);
        if (n >= at + 3)
            memmove(pair + at + 1, pair + at + 2, (n - at - 3) * sizeof *pair);
        n--;
        if (at > first)
            pair[at - 1] = pair_id(t, buf, cap, ids[at - 1], ids[at]);
        if (at + 1 < n)
            pair[at] = pair_id(t, buf, cap, ids[at], ids[at + 1]);
    }
    free(buf);
    free(pair);
    return (long)n;
}

const char *tok_decode(tokenizer *t, uint32_t prev, uint32_t id)
{
    if (id >= t->vocab)
        return "";
    const char *p = t->pieces[id];
    if (prev == TOK_BOS && p[0] == ' ')
        p++;
    unsigned byte;
    char tail;
    if (sscanf(p, "<0x%02X>%c", &byte, &tail) == 1 && strlen(p) == 6) {
        t->byte_piece[0] = (char)byte;
        t->byte_piece[1] = '\0';
        return t->byte_piece;
    }
    return p;
}
