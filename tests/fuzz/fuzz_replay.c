/*
 * fuzz_replay - `kvstash replay`'s command line and trace parser
 * (client/replay.c) through replay_run, the entry the CLI calls: options,
 * policy set-up, then every trace line through the policy host.
 *
 * Input: the first line is the command line after "replay", split on
 * blanks (at most FUZZ_MAX_ARGS words; e.g. "--policy h2o --set budget=4"),
 * the rest is the trace (JSON Lines, docs/replay.md). Output and messages
 * go to /dev/null: replay_run must return 0, 1 or 2 (replay.h), whatever
 * it reads.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "replay.h"

#define FUZZ_MAX_ARGS 32

/* The replay tool builds whatever its operator asks for: any geometry, any
 * number of tokens, and its memory and time grow with them (--layers 677777
 * took 15 s under ASan; {"append": 206559903} on 30 layers passed 2 GB: no
 * bug, just work; docs/reliability.md). The trace parser is what this
 * target is for, so inputs asking for more than FUZZ_MAX_GEOMETRY of a
 * geometry dimension, or more than FUZZ_MAX_TOKENS tokens in all (appends
 * and steps' new_tokens: the daemon's largest Append), are skipped. */
#define FUZZ_MAX_GEOMETRY 16
#define FUZZ_MAX_TOKENS 65536

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static FILE *sink;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    sink = fopen("/dev/null", "w");
    if (sink == NULL)
        abort();
    return 0;
}

/* Whether argv asks for a geometry dimension above FUZZ_MAX_GEOMETRY
 * ("--layers N" or "--layers=N"; replay.c's numeric options). */
static int geometry_too_large(int argc, char **argv)
{
    static const char *const dims[] = {"--layers", "--block-tokens", "--q-heads", "--kv-heads",
                                       "--head-dim"};
    for (int i = 1; i < argc; i++)
        for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++) {
            size_t n = strlen(dims[k]);
            if (strncmp(argv[i], dims[k], n) != 0)
                continue;
            const char *v = argv[i][n] == '='                    ? argv[i] + n + 1
                            : argv[i][n] == '\0' && i + 1 < argc ? argv[i + 1]
                                                                 : NULL;
            if (v != NULL && strtoull(v, NULL, 10) > FUZZ_MAX_GEOMETRY)
                return 1;
        }
    return 0;
}

/* Tokens the trace's lines ask for, read as replay reads them (one JSON
 * object a line); a line that is not one counts nothing (replay refuses it). */
static uint64_t trace_tokens(const char *trace, size_t len)
{
    uint64_t total = 0;
    while (len > 0) {
        const char *nl = memchr(trace, '\n', len);
        size_t n = nl != NULL ? (size_t)(nl - trace) + 1 : len;
        json_t *line = json_loadb(trace, n, JSON_DISABLE_EOF_CHECK, NULL);
        json_t *step = json_object_get(line, "step");
        json_int_t a = json_integer_value(json_object_get(line, "append"));
        json_int_t t = json_integer_value(json_object_get(step, "new_tokens"));
        total += (uint64_t)(a > 0 ? a : 0) + (uint64_t)(t > 0 ? t : 0);
        json_decref(line);
        trace += n;
        len -= n;
    }
    return total;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nl = memchr(data, '\n', size);
    size_t cmd_len = nl != NULL ? (size_t)(nl - data) : size;
    char *cmd = malloc(cmd_len + 1);
    if (cmd == NULL)
        return 0;
    memcpy(cmd, data, cmd_len);
    cmd[cmd_len] = '\0';
    char *argv[FUZZ_MAX_ARGS + 2] = {"replay"};
    int argc = 1;
    char *save = NULL;
    for (char *w = strtok_r(cmd, " \t", &save); w != NULL && argc <= FUZZ_MAX_ARGS;
         w = strtok_r(NULL, " \t", &save))
        argv[argc++] = w;
    argv[argc] = NULL;
    size_t skip = nl != NULL ? cmd_len + 1 : size;
    if (geometry_too_large(argc, argv) ||
        trace_tokens((const char *)data + skip, size - skip) > FUZZ_MAX_TOKENS) {
        free(cmd);
        return 0;
    }
    /* The trace: whatever follows the first line (fmemopen wants a size > 0). */
    static char empty[1] = "";
    char *trace = size > skip ? malloc(size - skip) : NULL;
    if (trace != NULL)
        memcpy(trace, data + skip, size - skip);
    FILE *in = trace != NULL ? fmemopen(trace, size - skip, "r") : fmemopen(empty, 1, "r");
    if (in == NULL)
        abort();
    int rc = replay_run(argc, argv, in, sink, sink);
    if (rc < 0 || rc > 2) {
        fprintf(stderr, "replay_run returned %d\n", rc);
        abort();
    }
    fclose(in);
    free(trace);
    free(cmd);
    return 0;
}
