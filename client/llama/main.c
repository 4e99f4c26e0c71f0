/*
 * main.c - kvstash-llama: a llama2.c-format model whose KV cache lives in
 * kvstashd (issue 5). Subcommands:
 *
 *   generate  text from a prompt (greedy, or sampled with --temperature),
 *             showing what the cache holds as it goes (--watch N)
 *   score     per-token negative log-likelihood of a text file's stories
 *             (separated by <|endoftext|>, each BOS-prefixed and truncated
 *             to the model's context); the last line of stdout is one JSON
 *             object: nll, ppl, tokens, stories, kv_dtype, kv_bytes_peak,
 *             kv_bytes_mean, kv_bytes_full_mean (docs/quality/README.md)
 *
 * score --export-at K / --import-file (one story; issue 17): a story scored
 * part here, part on another kvstashd, the sequence moving between them
 * through their remote tier (kvs_seq_export / kvs_seq_import). Step p feeds
 * token p and predicts token p + 1, which --per-token reports as position
 * p + 1. --export-at K runs steps 0..K-1 (the cache then holds positions
 * 0..K-1; --per-token lines 1..K), exports the sequence and writes "uid K"
 * to --export-file; --import-file imports it and runs steps K..n-2 (lines
 * K+1..n-1, n the story's tokens). Together: an uninterrupted run's lines.
 * Policies whose steps carry the worker's statistics of earlier tokens (the
 * SnapKV family's observation window, criticalkv's value norms) also move
 * the worker's state: --export-at writes it to PATH.worker beside the
 * export file, --import-file reads it from there (cache.h).
 *
 * --no-daemon runs the same forward pass with a plain in-process KV array
 * (the reference the tests compare with). `kvstash-llama --help` lists the
 * options; docs/quality/README.md explains --budget per policy.
 *
 * Exit status: 0 ok, 1 runtime error (model, daemon, policy), 2 usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "cache.h"
#include "model.h"
#include "tokenizer.h"

/* --demote int8|int4|int2 (--int8 on: int8) asks kvstashd to demote every
 * held token but the newest INT8_WINDOW of each list to that tier (the
 * storage keys of policies/storage.h: demote=T, int8_window=N; --set
 * overrides either). A quantised block fills one pool block, its
 * parameters included, so what that saves depends on the block size
 * (docs/tiers.md; nothing for INT8 at 4-token fp16 blocks of stories260K). */
#define INT8_WINDOW "8"

/* The reference every kv_bytes figure is a share of: an fp16 cache of
 * every token at the same step (what serving engines keep), whatever the
 * pool's dtype, so that fp32 pools show their real cost (twice as much)
 * instead of flattering INT8. docs/quality/README.md "How bytes are
 * counted". */
#define FULL_CACHE_ELT_BYTES 2

static const char *dtype_name(kvs_dtype d)
{
    return d == KVS_FP32 ? "fp32" : d == KVS_BF16 ? "bf16" : "fp16";
}

typedef struct opts {
    const char *cmd, *model, *tokenizer, *text, *prompt, *per_token;
    int no_daemon, quiet;
    /* --export-at K --export-file PATH, --import-file PATH */
    const char *export_file, *import_file;
    uint32_t export_at;
    int has_export_at, batch_set;
    const char *demote; /* "off", "int8", "int4", "int2" */
    uint32_t budget, stories, steps, watch, prompt_tokens, batch;
    double temperature;
    uint64_t seed;
    char model_name[64];
    cache_opts c;
    /* storage behind the strings above that this program makes up */
    char model_default[4096], tok_default[4096], text_default[4096];
    char set_buf[CACHE_MAX_PARAMS][128]; /* --set KEY=VALUE, split at '=' */
    char values[CACHE_MAX_PARAMS][32];   /* values of the --budget mapping */
} opts;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvstash-llama generate|score [options]\n"
            "  --model PATH          llama2.c checkpoint (default ../shared/data/stories260K.bin)\n"
            "  --tokenizer PATH      tokenizer.bin (default tok512.bin beside the model)\n"
            "  --policy NAME         kvstashd policy (default full)\n"
            "  --set KEY=VALUE       a policy parameter (repeatable; wins over --budget)\n"
            "  --budget N            tokens per layer, mapped to the policy's own parameters\n"
            "  --demote off|int8|int4|int2  all but the newest " INT8_WINDOW " tokens per list "
            "in that tier (default off)\n"
            "  --int8 on|off         the same as --demote int8 / off\n"
            "  --socket PATH         kvstashd's socket (default: kvs_default_socket())\n"
            "  --no-daemon           plain in-process KV array instead of kvstashd\n"
            "  --kv-dtype fp16|bf16|fp32  the element type K and V are stored in, in kvstashd's "
            "pool (default fp16, what engines keep; --dtype is the same option)\n"
            "  --block-tokens N      the pool's block size (default 4)\n"
            "  --model-name NAME     the pool's model name (default: the file's base name)\n"
            "score:\n"
            "  --text PATH           stories separated by <|endoftext|> (default "
            "../shared/data/tinystories_val_dev.txt)\n"
            "  --stories N           only the first N stories (default all)\n"
            "  --prompt-tokens P     the first P tokens of a story are a prompt (one prefill "
            "step); default 0\n"
            "  --per-token FILE      write one line per scored token: story position logprob\n"
            "  --batch B             stories scored side by side, each its own sequence "
            "(default 8)\n"
            "  --quiet               no per-story lines on stderr\n"
            "  --export-at K         score one story's steps 0..K-1 (lines 1..K), then export "
            "the sequence to kvstashd's remote tier and write \"uid K\" to --export-file\n"
            "  --export-file PATH    where --export-at writes the export's uid and K (and "
            "PATH.worker, the worker's statistics, for the SnapKV family and criticalkv)\n"
            "  --import-file PATH    import the export PATH names (\"uid K\") instead of "
            "starting the story, and score its steps K.. (lines K+1..); with --export-at K2, "
            "export again at K2\n"
            "                        (both: one story, --stories 1, --batch 1, through "
            "kvstashd)\n"
            "generate:\n"
            "  --prompt TEXT         (default \"Once upon a time\")\n"
            "  --steps N             tokens to generate at most (default 256)\n"
            "  --temperature T       0 = greedy (default), else sample softmax(logits / T)\n"
            "  --seed S              sampling seed (default 1)\n"
            "  --watch N             every N tokens, show what the cache holds (stderr)\n");
}

static void die(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvstash-llama: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(code);
}

static uint32_t parse_u32(const char *flag, const char *v)
{
    char *end;
    errno = 0;
    unsigned long x = strtoul(v, &end, 10);
    if (*v == '\0' || *v == '-' || *end != '\0' || errno != 0 || x > UINT32_MAX)
        die(2, "%s needs a non-negative integer, got '%s'", flag, v);
    return (uint32_t)x;
}

static int has_param(const opts *o, const char *key)
{
    for (size_t i = 0; i < o->c.nparams; i++)
        if (strcmp(o->c.params[i].key, key) == 0)
            return 1;
    return 0;
}

static void add_param(opts *o, const char *key, uint32_t value)
{
    if (has_param(o, key))
        return; /* the user's --set wins */
    if (o->c.nparams == CACHE_MAX_PARAMS)
        die(2, "too many parameters");
    snprintf(o->values[o->c.nparams], sizeof o->values[0], "%u", value);
    o->c.params[o->c.nparams] = (kvs_param){key, o->values[o->c.nparams]};
    o->c.nparams++;
}

static uint32_t round_up(uint32_t x, uint32_t m)
{
    return (x + m - 1) / m * m;
}

/* --budget N, in tokens per layer (per KV head on average for the per-head
 * policies), as each policy's own parameters; docs/quality/README.md. */
static void map_budget(opts *o)
{
    uint32_t N = o->budget, B = o->c.block_tokens;
    const char *p = o->c.policy;
    if (N == 0)
        return;
    if (strcmp(p, "full") == 0)
        die(2, "--budget: policy full keeps every token");
    if (N < 8)
        die(2, "--budget must be at least 8 tokens");
    if (strcmp(p, "streaming") == 0) {
        add_param(o, "n_sink", 4);
        add_param(o, "window", N - 4);
    } else if (strcmp(p, "h2o") == 0 || strcmp(p, "tova") == 0 || strcmp(p, "reviver") == 0) {
        add_param(o, "budget", N);
    } else if (strcmp(p, "snapkv") == 0 || strcmp(p, "adakv") == 0 ||
               strcmp(p, "criticalkv") == 0 || strcmp(p, "criticalkv_ada") == 0) {
        add_param(o, "budget", N);
        add_param(o, "window", N / 4 < 32 ? N / 4 : 32); /* must stay below the budget */
    } else if (strcmp(p, "ov_block") == 0) {
        uint32_t start = round_up(4, B), recent = round_up(N / 4 > B ? N / 4 : B, B);
        uint32_t max = round_up(N, B);
        if (max <= start + recent)
            die(2, "--budget %u is too small for ov_block with %u-token blocks", N, B);
        add_param(o, "start_size", start);
        add_param(o, "recent_size", recent);
        add_param(o, "max_cache_size", max);
    } else if (strcmp(p, "confkv") == 0) {
        add_param(o, "budget_tight", N);
        add_param(o, "budget_loose", 2 * N);
        add_param(o, "protect", N / 4);
        add_param(o, "fp16_window", N / 2);
    } else if (strcmp(p, "weightedkv") == 0) {
        add_param(o, "cache_size", N);
        add_param(o, "n_init", 4);
        add_param(o, "n_recent", N / 2 - 4);
    } else {
        die(2, "--budget: no mapping for policy %s; use --set", p);
    }
}

/* --export-at / --export-file / --import-file: what can work. The story's
 * length is checked once it is tokenized (lane_start). */
static void check_moving(opts *o)
{
    int moving = o->has_export_at || o->export_file != NULL || o->import_file != NULL;
    if (!moving)
        return;
    if (o->has_export_at != (o->export_file != NULL))
        die(2, "--export-at K and --export-file PATH go together");
    if (strcmp(o->cmd, "score") != 0)
        die(2, "--export-at and --import-file are options of score, not %s", o->cmd);
    if (o->no_daemon)
        die(2, "--export-at and --import-file move a kvstashd sequence: not with --no-daemon");
    if (o->has_export_at && o->export_at == 0)
        die(2, "--export-at must be at least 1 (the tokens fed before the export)");
    if (o->batch_set && o->batch != 1)
        die(2, "--export-at and --import-file score one story: --batch 1, not %u", o->batch);
    o->batch = 1;
}

/* The directory part of path, with a trailing '/', or "" */
static void dir_of(const char *path, char *out, size_t len)
{
    const char *slash = strrchr(path, '/');
    size_t n = slash ? (size_t)(slash - path + 1) : 0;
    snprintf(out, len, "%.*s", (int)n, path);
}

static void parse(int argc, char **argv, opts *o)
{
    const char *shared = getenv("KVSTASH_SHARED_DIR");
    memset(o, 0, sizeof *o);
    snprintf(o->model_default, sizeof o->model_default, "%s/data/stories260K.bin",
             shared ? shared : "../shared");
    snprintf(o->text_default, sizeof o->text_default, "%s/data/tinystories_val_dev.txt",
             shared ? shared : "../shared");
    o->model = o->model_default;
    o->text = o->text_default;
    o->prompt = "Once upon a time";
    o->steps = 256;
    o->batch = 8;
    o->seed = 1;
    o->demote = "off";
    o->c = (cache_opts){.policy = "full", .block_tokens = 4, .dtype = KVS_FP16};
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        exit(argc < 2 ? 2 : 0);
    }
    o->cmd = argv[1];
    if (strcmp(o->cmd, "generate") != 0 && strcmp(o->cmd, "score") != 0)
        die(2, "unknown subcommand '%s' (generate or score)", o->cmd);
    const char *name = NULL;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            exit(0);
        }
        if (strcmp(a, "--no-daemon") == 0) {
            o->no_daemon = 1;
            continue;
        }
        if (strcmp(a, "--quiet") == 0) {
            o->quiet = 1;
            continue;
        }
        if (i + 1 >= argc)
            die(2, "%s needs a value", a);
        const char *v = argv[++i];
        if (strcmp(a, "--model") == 0)
            o->model = v;
        else if (strcmp(a, "--tokenizer") == 0)
            o->tokenizer = v;
        else if (strcmp(a, "--text") == 0)
            o->text = v;
        else if (strcmp(a, "--policy") == 0)
            o->c.policy = v;
        else if (strcmp(a, "--socket") == 0)
            o->c.socket = v;
        else if (strcmp(a, "--model-name") == 0)
            name = v;
        else if (strcmp(a, "--budget") == 0)
            o->budget = parse_u32(a, v);
        else if (strcmp(a, "--stories") == 0)
            o->stories = parse_u32(a, v);
        else if (strcmp(a, "--steps") == 0)
            o->steps = parse_u32(a, v);
        else if (strcmp(a, "--batch") == 0)
            o->batch = parse_u32(a, v), o->batch_set = 1;
        else if (strcmp(a, "--export-at") == 0)
            o->export_at = parse_u32(a, v), o->has_export_at = 1;
        else if (strcmp(a, "--export-file") == 0)
            o->export_file = v;
        else if (strcmp(a, "--import-file") == 0)
            o->import_file = v;
        else if (strcmp(a, "--watch") == 0)
            o->watch = parse_u32(a, v);
        else if (strcmp(a, "--prompt-tokens") == 0)
            o->prompt_tokens = parse_u32(a, v);
        else if (strcmp(a, "--block-tokens") == 0)
            o->c.block_tokens = parse_u32(a, v);
        else if (strcmp(a, "--seed") == 0)
            o->seed = parse_u32(a, v);
        else if (strcmp(a, "--prompt") == 0)
            o->prompt = v;
        else if (strcmp(a, "--per-token") == 0)
            o->per_token = v;
        else if (strcmp(a, "--temperature") == 0) {
            char *end;
            o->temperature = strtod(v, &end);
            if (*v == '\0' || *end != '\0' || !(o->temperature >= 0) || o->temperature > 100)
                die(2, "--temperature needs a number in [0, 100], got '%s'", v);
        } else if (strcmp(a, "--int8") == 0) {
            if (strcmp(v, "on") != 0 && strcmp(v, "off") != 0)
                die(2, "--int8 takes on or off, got '%s'", v);
            o->demote = strcmp(v, "on") == 0 ? "int8" : "off";
        } else if (strcmp(a, "--demote") == 0) {
            if (strcmp(v, "off") != 0 && strcmp(v, "int8") != 0 && strcmp(v, "int4") != 0 &&
                strcmp(v, "int2") != 0)
                die(2, "--demote takes off, int8, int4 or int2, got '%s'", v);
            o->demote = v;
        } else if (strcmp(a, "--kv-dtype") == 0 || strcmp(a, "--dtype") == 0) {
            if (strcmp(v, "fp32") == 0)
                o->c.dtype = KVS_FP32;
            else if (strcmp(v, "fp16") == 0)
                o->c.dtype = KVS_FP16;
            else if (strcmp(v, "bf16") == 0)
                o->c.dtype = KVS_BF16;
            else
                die(2, "%s takes fp16, bf16 or fp32, got '%s'", a, v);
        } else if (strcmp(a, "--set") == 0) {
            size_t k = o->c.nparams;
            if (k == CACHE_MAX_PARAMS || strlen(v) >= sizeof o->set_buf[0])
                die(2, "--set: too many or too long");
            snprintf(o->set_buf[k], sizeof o->set_buf[k], "%s", v);
            char *eq = strchr(o->set_buf[k], '=');
            if (eq == NULL || eq == o->set_buf[k])
                die(2, "--set wants KEY=VALUE, got '%s'", v);
            *eq = '\0';
            o->c.params[o->c.nparams++] = (kvs_param){o->set_buf[k], eq + 1};
        } else {
            die(2, "unknown option %s (see --help)", a);
        }
    }
    if (o->batch == 0 || o->batch > LLM_MAX_BATCH)
        die(2, "--batch must be in 1..%d", LLM_MAX_BATCH);
    check_moving(o);
    if (o->c.block_tokens == 0 || o->c.block_tokens > 4096)
        die(2, "--block-tokens must be in 1..4096");
    if (o->tokenizer == NULL) {
        char dir[4000];
        dir_of(o->model, dir, sizeof dir);
        snprintf(o->tok_default, sizeof o->tok_default, "%s%s", dir, "tok512.bin");
        o->tokenizer = o->tok_default;
    }
    if (name == NULL) {
        const char *base = strrchr(o->model, '/');
        base = base ? base + 1 : o->model;
        size_t n = strcspn(base, ".");
        snprintf(o->model_name, sizeof o->model_name, "%.*s", (int)n, base);
    } else {
        snprintf(o->model_name, sizeof o->model_name, "%s", name);
    }
    o->c.model_name = o->model_name;
    int demote = strcmp(o->demote, "off") != 0;
    if (o->no_daemon && (o->budget || demote || o->c.nparams || strcmp(o->c.policy, "full") != 0))
        die(2, "--no-daemon runs the full cache only (no --policy, --set, --budget, --int8 or "
               "--demote)");
    map_budget(o);
    const kvs_param demote_params[] = {{"demote", o->demote}, {"int8_window", INT8_WINDOW}};
    for (size_t i = 0; demote && i < 2; i++)
        if (!has_param(o, demote_params[i].key)) {
            if (o->c.nparams == CACHE_MAX_PARAMS)
                die(2, "too many parameters");
            o->c.params[o->c.nparams++] = demote_params[i];
        }
}

/* ---- the forward pass ------------------------------------------------------ */

/* One sequence being processed: its activations, its cache, its tokens. */
typedef struct lane {
    llm_state st;
    llm_cache *cache;
    int busy;
    uint32_t story;
    uint32_t *ids;
    long n, pos;
    long first, end; /* steps first..end-1 run here (0 and n-1 but when moving) */
    double nll;
    double *lp; /* per-token log-probabilities, for --per-token */
} lane;

typedef struct run {
    const opts *o;
    llm_model m;
    tokenizer *tok;
    lane *lanes;
    size_t nlanes;
    /* usage over all steps, in bytes (integers: exact in any order) */
    uint64_t steps, bytes_peak, bytes_sum, full_bytes_sum;
} run;

/* One token for each of the nb lanes in `ls` (lane b at ls[b]->pos with
 * token ls[b]->ids[pos], or `tokens` when given); logits in each lane's st. */
static void forward(run *r, lane *const *ls, size_t nb, const uint32_t *tokens)
{
    llm_state *sts[LLM_MAX_BATCH] = {NULL}; /* zeroed: GCC -O1 + sanitizers warns otherwise */
    uint32_t pos[LLM_MAX_BATCH];
    for (size_t b = 0; b < nb; b++) {
        pos[b] = (uint32_t)ls[b]->pos;
        sts[b] = &ls[b]->st;
        if (cache_token_begin(ls[b]->cache, pos[b]) != 0)
            die(1, "%s", cache_error(ls[b]->cache));
        llm_embed(&r->m, sts[b], tokens ? tokens[b] : ls[b]->ids[pos[b]]);
    }
    for (uint32_t l = 0; l < r->m.c.n_layers; l++) {
        llm_layer_qkv(&r->m, sts, nb, l, pos);
        for (size_t b = 0; b < nb; b++)
            if (cache_layer(ls[b]->cache, l, sts[b]) != 0)
                die(1, "%s", cache_error(ls[b]->cache));
        llm_layer_finish(&r->m, sts, nb, l);
    }
    llm_logits(&r->m, sts, nb);
    for (size_t b = 0; b < nb; b++) {
        cache_usage u;
        cache_get_usage(ls[b]->cache, &u);
        r->steps++;
        r->bytes_sum += u.bytes;
        r->full_bytes_sum +=
            (uint64_t)(pos[b] + 1) * r->m.c.n_layers * r->m.c.kv_dim * 2 * FULL_CACHE_ELT_BYTES;
        if (u.bytes > r->bytes_peak)
            r->bytes_peak = u.bytes;
    }
}

static void end_token(lane *ln, int prefill, int defer)
{
    cache_step s = {prefill, defer, ln->st.logits};
    if (cache_token_end(ln->cache, &s) != 0)
        die(1, "%s", cache_error(ln->cache));
}

static void run_open(run *r, const opts *o, size_t nlanes)
{
    char err[512];
    memset(r, 0, sizeof *r);
    r->o = o;
    if (llm_model_load(o->model, &r->m, err, sizeof err) != 0)
        die(1, "%s", err);
    r->tok = tok_load(o->tokenizer, r->m.c.vocab_size, err, sizeof err);
    if (r->tok == NULL)
        die(1, "%s", err);
    r->lanes = calloc(nlanes, sizeof *r->lanes);
    if (r->lanes == NULL)
        die(1, "out of memory");
    r->nlanes = nlanes;
    for (size_t i = 0; i < nlanes; i++) {
        lane *ln = &r->lanes[i];
        if (llm_state_init(&ln->st, &r->m.c) != 0)
            die(1, "out of memory");
        if (o->no_daemon) {
            ln->cache = cache_plain(&r->m);
            if (ln->cache == NULL)
                die(1, "out of memory");
        } else if (cache_kvstash(&r->m, &o->c, &ln->cache, err, sizeof err) != 0) {
            die(1, "%s", err);
        }
    }
}

static void run_close(run *r)
{
    for (size_t i = 0; i < r->nlanes; i++) {
        cache_free(r->lanes[i].cache);
        llm_state_free(&r->lanes[i].st);
        free(r->lanes[i].ids);
        free(r->lanes[i].lp);
    }
    free(r->lanes);
    tok_free(r->tok);
    llm_model_free(&r->m);
}

static void seq_begin(lane *ln, const char *label)
{
    if (cache_seq_begin(ln->cache, label) != 0)
        die(1, "%s", cache_error(ln->cache));
}

/* ---- score ------------------------------------------------------------------ */

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        die(1, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf != NULL && (got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (n + 1 == cap) {
            char *p = realloc(buf, cap *= 2);
            if (p == NULL)
                free(buf);
            buf = p;
        }
    }
    fclose(f);
    if (buf == NULL)
        die(1, "out of memory reading %s", path);
    buf[n] = '\0';
    return buf;
}

static int is_space(char c)
{
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

/* The next story of the text (NUL-terminated in place, whitespace trimmed),
 * or NULL at the end. *cursor moves past it. */
static char *next_story(char **cursor)
{
    static const char sep[] = "<|endoftext|>";
    while (*cursor != NULL) {
        char *s = *cursor, *end = strstr(s, sep);
        if (end != NULL) {
            *end = '\0';
            *cursor = end + sizeof sep - 1;
        } else {
            *cursor = NULL;
        }
        while (is_space(*s))
            s++;
        size_t n = strlen(s);
        while (n > 0 && is_space(s[n - 1]))
            s[--n] = '\0';
        if (n > 0)
            return s;
    }
    return NULL;
}

/* What each story gave, kept by story so that totals do not depend on which
 * lane finished first. */
typedef struct story_result {
    double nll;
    uint64_t first, tokens, evicted; /* lp[first..first+tokens-1] were scored */
    double *lp;
} story_result;

/* What --import-file names. */
typedef struct import_ref {
    char uid[KVS_EXPORT_UID_LEN + 1];
    uint32_t at;
} import_ref;

/* PATH.worker: the worker's state of the export PATH names (cache.h). */
static void worker_path(const char *path, char *out, size_t len)
{
    if (snprintf(out, len, "%s.worker", path) >= (int)len)
        die(2, "%s: path too long", path);
}

/* Read "uid K" from path (exit 1 if it cannot be read, 2 if it is not that). */
static void read_import(const char *path, import_ref *ir)
{
    char *text = read_file(path), uid[64], extra[2];
    unsigned long at = 0;
    int n = sscanf(text, "%63s %lu %1s", uid, &at, extra);
    size_t len = n >= 1 ? strlen(uid) : 0;
    int hex = len == KVS_EXPORT_UID_LEN && strspn(uid, "0123456789abcdef") == len;
    free(text);
    if (n != 2 || !hex || at == 0 || at > UINT32_MAX)
        die(2,
            "--import-file %s: expected one line \"UID K\" (32 hex digits, K >= 1), as "
            "--export-file writes",
            path);
    memcpy(ir->uid, uid, len + 1);
    ir->at = (uint32_t)at;
}

/* Write "uid K" to path, replacing it whole (a reader never sees half). */
static void write_export(const char *path, const char *uid, uint32_t at)
{
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        die(2, "--export-file: path too long");
    FILE *f = fopen(tmp, "w");
    int ok = f != NULL && fprintf(f, "%s %u\n", uid, at) > 0;
    ok = f != NULL && fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        die(1, "cannot write %s: %s", path, strerror(e));
    }
}

/* Steps first..end-1 of the story: all of them, or where the moving options
 * say (exit 2 when they do not fit the story). */
static void lane_range(const opts *o, lane *ln, const import_ref *ir)
{
    long n = ln->n, lo = o->prompt_tokens > 1 ? o->prompt_tokens : 1;
    ln->first = 0;
    ln->end = n - 1;
    if (!o->has_export_at && o->import_file == NULL)
        return;
    /* A cut after step K-1 needs a step there (not inside a prompt: its
     * tokens but the last are appended without one) and a step after it. */
    if (ir != NULL) {
        if ((long)ir->at < lo || (long)ir->at > n - 2)
            die(2,
                "--import-file %s: K = %u, but story %u has %ld tokens%s: K must be in "
                "%ld..%ld",
                o->import_file, ir->at, ln->story, n, o->prompt_tokens > 1 ? " and a prompt" : "",
                lo, n - 2);
        ln->first = ir->at;
    }
    if (o->has_export_at) {
        long min = ir != NULL ? (long)ir->at + 1 : lo;
        if ((long)o->export_at < min || (long)o->export_at > n - 2)
            die(2, "--export-at %u: story %u has %ld tokens%s%s: K must be in %ld..%ld",
                o->export_at, ln->story, n, o->prompt_tokens > 1 ? " and a prompt" : "",
                ir != NULL ? " and the import is at its own K" : "", min, n - 2);
        ln->end = o->export_at;
    }
}

/* Give an idle lane the next story; returns 0 when none is left. */
static int lane_start(run *r, lane *ln, char **stories, uint32_t *next, uint32_t nstories,
                      const import_ref *ir)
{
    uint32_t ctx = r->m.c.seq_len;
    while (*next < nstories) {
        const char *story = stories[*next];
        free(ln->ids);
        ln->ids = malloc((strlen(story) + 3) * sizeof *ln->ids);
        long n = ln->ids ? tok_encode(r->tok, story, 1, ln->ids) : -1;
        if (n < 0)
            die(1, "out of memory");
        ln->n = n > (long)ctx ? (long)ctx : n;
        ln->story = (*next)++;
        lane_range(r->o, ln, ir); /* before: a moved story must have its steps */
        if (ln->n < 2)
            continue; /* nothing to predict */
        if (ir != NULL) {
            uint32_t appended;
            char wp[4200];
            worker_path(r->o->import_file, wp, sizeof wp);
            if (cache_seq_import(ln->cache, ir->uid, wp, &appended) != 0)
                die(1, "%s", cache_error(ln->cache));
            if (appended != ir->at)
                die(1,
                    "import %s: the sequence has %u tokens appended, but %s says K = %u "
                    "(the file does not describe this export)",
                    ir->uid, appended, r->o->import_file, ir->at);
        } else {
            char label[32];
            snprintf(label, sizeof label, "story %u", ln->story);
            seq_begin(ln, label);
        }
        ln->pos = ln->first;
        ln->nll = 0;
        free(ln->lp);
        ln->lp = malloc((size_t)ln->n * sizeof *ln->lp);
        if (ln->lp == NULL)
            die(1, "out of memory");
        ln->busy = 1;
        return 1;
    }
    return 0;
}

static void lane_finish(run *r, lane *ln, story_result *res)
{
    cache_usage u;
    cache_get_usage(ln->cache, &u);
    if (r->o->has_export_at) {
        /* The cache holds positions 0..K-1, the step of K-1 done. */
        char uid[KVS_EXPORT_UID_LEN + 1], wp[4200];
        worker_path(r->o->export_file, wp, sizeof wp);
        /* the worker state first: once the export file names the export,
         * everything an import needs is there */
        if (cache_seq_export(ln->cache, wp, uid) != 0)
            die(1, "%s", cache_error(ln->cache));
        write_export(r->o->export_file, uid, (uint32_t)ln->end);
        if (!r->o->quiet)
            fprintf(stderr, "story %u: exported at K = %ld as %s\n", ln->story, ln->end, uid);
    }
    if (cache_seq_end(ln->cache) != 0)
        die(1, "%s", cache_error(ln->cache));
    story_result *sr = &res[ln->story];
    sr->nll = ln->nll;
    sr->first = (uint64_t)ln->first;
    sr->tokens = (uint64_t)(ln->end - ln->first);
    sr->evicted = u.evicted;
    sr->lp = ln->lp;
    ln->lp = NULL;
    ln->busy = 0;
    if (!r->o->quiet)
        fprintf(stderr, "story %u: %" PRIu64 " tokens, nll %.4f, evicted %" PRIu64 "\n", ln->story,
                sr->tokens, sr->nll / (double)sr->tokens, u.evicted);
}

static int cmd_score(const opts *o)
{
    run r;
    char *text = read_file(o->text), *cursor = text, *story;
    uint32_t nstories = 0, cap = 64;
    char **stories = malloc(cap * sizeof *stories);
    while (stories != NULL && (o->stories == 0 || nstories < o->stories) &&
           (story = next_story(&cursor)) != NULL) {
        if (nstories == cap) {
            char **p = realloc(stories, (cap *= 2) * sizeof *p);
            if (p == NULL)
                free(stories);
            stories = p;
        }
        if (stories != NULL)
            stories[nstories++] = story;
    }
    story_result *res = calloc(nstories ? nstories : 1, sizeof *res);
    if (stories == NULL || res == NULL)
        die(1, "out of memory");
    import_ref ir, *irp = NULL;
    if (o->has_export_at || o->import_file != NULL) {
        if (nstories != 1)
            die(2, "--export-at and --import-file score one story: --stories 1, not %u", nstories);
        if (o->import_file != NULL)
            read_import(o->import_file, irp = &ir);
    }
    run_open(&r, o, o->batch < nstories ? o->batch : (nstories ? nstories : 1));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint32_t next = 0;
    for (;;) {
        lane *active[LLM_MAX_BATCH];
        size_t nb = 0;
        for (size_t i = 0; i < r.nlanes; i++) {
            lane *ln = &r.lanes[i];
            if (ln->busy || lane_start(&r, ln, stories, &next, nstories, irp))
                active[nb++] = ln;
        }
        if (nb == 0)
            break;
        /* Positions 0..n-2 predict tokens 1..n-1; the last token's own
         * prediction is past the story. A moved story runs first..end-1. */
        forward(&r, active, nb, NULL);
        for (size_t b = 0; b < nb; b++) {
            lane *ln = active[b];
            double lp = llm_logprob(ln->st.logits, r.m.c.vocab_size, ln->ids[ln->pos + 1]);
            ln->lp[ln->pos] = lp;
            ln->nll -= lp;
            int in_prompt = (uint32_t)ln->pos + 1 < o->prompt_tokens;
            int ends_prompt = (uint32_t)ln->pos + 1 == o->prompt_tokens;
            end_token(ln, ends_prompt, in_prompt);
            if (++ln->pos >= ln->end)
                lane_finish(&r, ln, res);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double nll = 0;
    uint64_t tokens = 0, evicted = 0;
    FILE *pt = NULL;
    if (o->per_token != NULL && (pt = fopen(o->per_token, "w")) == NULL)
        die(1, "cannot write %s: %s", o->per_token, strerror(errno));
    for (uint32_t i = 0; i < nstories; i++) {
        nll += res[i].nll;
        tokens += res[i].tokens;
        evicted += res[i].evicted;
        for (uint64_t k = res[i].first; pt != NULL && k < res[i].first + res[i].tokens; k++)
            fprintf(pt, "%u %" PRIu64 " %.17g\n", i, k + 1, res[i].lp[k]);
        free(res[i].lp);
    }
    if (pt != NULL)
        fclose(pt);
    double mean = tokens ? nll / (double)tokens : 0.0;
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    double steps = r.steps ? (double)r.steps : 1.0;
    printf("{\"model\":\"%s\",\"policy\":\"%s\",\"budget\":%u,\"int8\":%s,\"demote\":\"%s\","
           "\"daemon\":%s,"
           "\"kv_dtype\":\"%s\","
           "\"nll\":%.17g,\"ppl\":%.17g,\"tokens\":%" PRIu64 ",\"stories\":%u,"
           "\"kv_bytes_peak\":%" PRIu64 ",\"kv_bytes_mean\":%.17g,\"kv_bytes_full_mean\":%.17g,"
           "\"evicted\":%" PRIu64 ",\"seconds\":%.3f}\n",
           o->model_name, o->no_daemon ? "none" : o->c.policy, o->budget,
           strcmp(o->demote, "int8") == 0 ? "true" : "false", o->demote,
           o->no_daemon ? "false" : "true", o->no_daemon ? "fp32" : dtype_name(o->c.dtype), mean,
           exp(mean), tokens, nstories, r.bytes_peak, (double)r.bytes_sum / steps,
           (double)r.full_bytes_sum / steps, evicted, secs);
    run_close(&r);
    free(res);
    free(stories);
    free(text);
    return 0;
}

/* ---- generate --------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

static uint32_t sample(const float *logits, uint32_t vocab, double temperature, uint64_t *rng)
{
    if (temperature == 0)
        return llm_argmax(logits, vocab);
    double mx = logits[0], sum = 0;
    for (uint32_t i = 1; i < vocab; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (uint32_t i = 0; i < vocab; i++)
        sum += exp((logits[i] - mx) / temperature);
    double u = (double)(rng_next(rng) >> 11) / 9007199254740992.0 * sum, acc = 0;
    for (uint32_t i = 0; i < vocab; i++) {
        acc += exp((logits[i] - mx) / temperature);
        if (u < acc)
            return i;
    }
    return vocab - 1;
}

/* "full 40 tok 10.0 KiB, int8 96 tok 8.0 KiB, sketch 0 tok" from a
 * SequenceStats JSON object's tiers (summed over layers). */
static void print_tiers(const char *seq_json)
{
    json_t *seq = json_loads(seq_json, 0, NULL), *t;
    size_t i;
    json_array_foreach(json_object_get(seq, "tiers"), i, t)
    {
        json_t *tok = json_object_get(t, "tokens"), *b = json_object_get(t, "bytes");
        /* proto3 JSON writes 64-bit integers as strings */
        double ntok = json_is_string(tok) ? atof(json_string_value(tok)) : json_number_value(tok);
        double bytes = json_is_string(b) ? atof(json_string_value(b)) : json_number_value(b);
        fprintf(stderr, "%s%s %.0f tok %.1f KiB", i ? ", " : "",
                json_string_value(json_object_get(t, "tier")), ntok, bytes / 1024);
    }
    json_decref(seq);
}

static void watch_line(run *r, uint32_t pos)
{
    cache_usage u;
    llm_cache *c = r->lanes[0].cache;
    cache_get_usage(c, &u);
    fprintf(stderr, "\n[kvstash pos %u] %.1f tokens/layer, evicted %" PRIu64, pos,
            (double)u.tokens / r->m.c.n_layers, u.evicted);
    char *js = cache_seq_stats_json(c);
    if (js != NULL) {
        fprintf(stderr, "; kvstashd holds: ");
        print_tiers(js);
        free(js);
    }
    fprintf(stderr, "\n");
}

static int cmd_generate(const opts *o)
{
    run r;
    run_open(&r, o, 1);
    lane *ln = &r.lanes[0];
    uint32_t *ids = malloc((strlen(o->prompt) + 3) * sizeof *ids);
    long np = ids ? tok_encode(r.tok, o->prompt, 1, ids) : -1;
    if (np < 1)
        die(1, "cannot encode the prompt");
    uint32_t ctx = r.m.c.seq_len;
    if ((uint32_t)np > ctx)
        die(1, "the prompt has %ld tokens; the model's context is %u", np, ctx);
    seq_begin(ln, "generate");
    uint64_t rng = o->seed * 0x9E3779B97F4A7C15ull + 1;
    uint32_t token = ids[0], generated = 0;
    for (ln->pos = 0; ln->pos < (long)ctx; ln->pos++) {
        forward(&r, &ln, 1, &token);
        int prompt = ln->pos + 1 < np;
        end_token(ln, ln->pos + 1 == np, prompt);
        uint32_t next = prompt ? ids[ln->pos + 1]
                               : sample(ln->st.logits, r.m.c.vocab_size, o->temperature, &rng);
        if (!prompt && (next == TOK_BOS || next == TOK_EOS || generated == o->steps))
            break;
        fputs(tok_decode(r.tok, token, next), stdout); /* no leading space after BOS */
        fflush(stdout);
        generated += !prompt;
        token = next;
        if (o->watch && !prompt && generated % o->watch == 0)
            watch_line(&r, (uint32_t)ln->pos);
    }
    printf("\n");
    if (o->watch && generated % o->watch != 0)
        watch_line(&r, (uint32_t)ln->pos);
    free(ids);
    if (cache_seq_end(ln->cache) != 0)
        die(1, "%s", cache_error(ln->cache));
    run_close(&r);
    return 0;
}

int main(int argc, char **argv)
{
    opts o;
    parse(argc, argv, &o);
    return strcmp(o.cmd, "score") == 0 ? cmd_score(&o) : cmd_generate(&o);
}
