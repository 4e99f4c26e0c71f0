/*
 * cli.h - the pieces of `kvstash`, the operator CLI, shared by its command
 * files: cli.c (main, global options, status, workers, seqs, policy list),
 * cli_seq.c (seq show, evict, demote, offload, revive), cli_live.c (watch,
 * top, replay's progress).
 *
 * Every command prints its result on stdout (one JSON document, or JSON
 * lines for the streaming commands, with --json) and every error as one line
 * "kvstash: <reason>" on stderr, then exits with one of the codes below.
 */
#ifndef KVSTASH_CLI_H
#define KVSTASH_CLI_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>
#include <protobuf-c/protobuf-c.h>

#include "kvstash/v1/store.pb-c.h"

/* Exit codes (kvstash --help lists them). */
enum {
    CLI_OK = 0,
    CLI_ERROR = 1,       /* the daemon refused the request, or something else failed */
    CLI_USAGE = 2,       /* bad command line */
    CLI_UNREACHABLE = 3, /* kvstashd is not running, or does not answer */
    CLI_NOT_FOUND = 4,   /* no such sequence */
    CLI_DENIED = 5,      /* permission denied */
};

/* The command line, once the global options are read. */
typedef struct cli {
    const char *socket; /* --socket, or the default */
    /* --addr HOST:PORT: call kvstashd's TCP port instead (health, or with a
     * token); --tls-ca/--tls-cert/--tls-key or $KVSTASH_TLS_* for its TLS. */
    const char *addr, *tls_ca, *tls_cert, *tls_key;
    int json;        /* --json */
    const char *cmd; /* "seq show", for messages */
    int argc;        /* the command's own arguments (after its name) */
    char **argv;
} cli;

/* Print "kvstash: <message>" on stderr; returns `code`. */
int cli_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* While on, cli_fail keeps its message (cli_deferred_error) instead of
 * printing it: `top` owns the screen. */
void cli_defer_errors(int on);
const char *cli_deferred_error(void);

/* A command-specific option: --name VALUE (has_arg) or --name (sets *flag). */
typedef struct cli_opt {
    const char *name;
    int has_arg;
    const char **value; /* has_arg: receives the last value given */
    int *flag;          /* !has_arg: set to 1 */
    /* has_arg, repeatable: called for every value; returns 0 or a CLI_ code */
    int (*each)(void *ctx, const char *value);
    void *ctx;
} cli_opt;

/*
 * Parse c->argv: the command's options (plus --socket, --json and --help,
 * accepted anywhere) and between min_pos and max_pos positional arguments,
 * stored in pos[]. `help` is the command's usage text. Returns CLI_OK, -1
 * when --help was printed (exit 0), or CLI_USAGE after a one-line message.
 */
int cli_parse(cli *c, const cli_opt *opts, size_t nopts, const char **pos, size_t min_pos,
              size_t max_pos, size_t *npos, const char *help);

/* Parse an unsigned integer (decimal, at most max); 0 or -1. */
int cli_uint(const char *text, uint64_t max, uint64_t *out);

/*
 * One unary call to kvstashd (method: "Stats", ..., of kvstash.v1.Store, or a
 * full path "/grpc.health.v1.Health/Check"), with `token` as the
 * kvstash-token metadata (NULL: none). On success returns CLI_OK and *resp
 * (free with protobuf_c_message_free_unpacked). On failure prints the
 * one-line reason (not running, permission denied, the daemon's message) and
 * returns the exit code.
 */
int cli_call(const cli *c, const char *method, const char *token, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp);

/* A session token from the fd socket's handshake (the daemon reads our uid
 * there); *fd holds the session: close it when done. Errors as cli_call. */
int cli_token(const cli *c, int *fd, char token[33]); /* FDSOCK_TOKEN_LEN + 1 */

/* cli_call for the views (Stats, Inspect) as who we are. kvstashd credits a
 * call without a token with its own uid (docs/reliability.md), which
 * is ours when we run as the socket's owner; under another uid (root) we
 * identify ourselves with cli_token first, so that an operator's uid counts. */
int cli_call_view(const cli *c, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp);

/* cli_call with a session token from cli_token, so that kvstashd knows our
 * uid (an operator's acts on any session's sequences). */
int cli_call_as_us(const cli *c, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp);

/* Stats (with per-sequence tiers when with_tiers); errors as cli_call. */
int cli_stats(const cli *c, int with_tiers, Kvstash__V1__StatsResponse **out);

/* Print a message as JSON on stdout (pretty when `pretty`), one line else. */
int cli_print_message(const ProtobufCMessage *m, int pretty);
int cli_print_json(json_t *j, int pretty); /* takes the reference */

/* "512 B", "3.0 KiB"; "1.5s", "2m 3s", "1h 2m 3s". */
const char *cli_bytes(uint64_t b, char *buf, size_t len);
const char *cli_duration(uint64_t ms, char *buf, size_t len);
const char *cli_dtype(Kvstash__V1__DType d);

/* Commands: each returns the exit code. */
int cli_cmd_seq(cli *c);
int cli_cmd_evict(cli *c, const char *name); /* evict, demote, offload, revive */
int cli_cmd_watch(cli *c);
int cli_cmd_top(cli *c);
int cli_cmd_replay(int argc, char **argv); /* replay_main, with progress on a TTY */

#endif
