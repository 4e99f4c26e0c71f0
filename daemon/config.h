/*
 * config.h - kvstashd's settings: defaults, an INI file (inih), then flags.
 *
 * Every command-line flag is also a key of the config file, spelt like the
 * flag without the dashes ('-' and '_' are the same: pool-mb = pool_mb), in
 * a [kvstashd] section or before any section:
 *
 *     [kvstashd]
 *     socket = /run/kvstash/kvstashd.sock
 *     pool_mb = 1024
 *     metrics = 127.0.0.1:9464
 *
 * `kvstashd --config FILE` reads it, flags given on the command line win over
 * it, and `kvstashd --print-config` prints the result in the same format
 * (ops/kvstashd.conf is the annotated example).
 */
#ifndef KVSTASH_CONFIG_H
#define KVSTASH_CONFIG_H

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

#include "background.h"

#define CONFIG_MAX_UIDS 16

typedef struct daemon_config {
    char socket[PATH_MAX - 16]; /* gRPC socket; PATH.fd etc. beside it */
    char listen[128];           /* TCP gRPC address, "" = none */
    unsigned long pool_mb, max_pools, max_sessions, max_seqs, threads;
    unsigned long policy_threads;
    unsigned long pending_timeout_ms, max_pending; /* fd-socket admission (fdsock.h) */
    unsigned long lease_timeout_ms;                /* 0 = leases never expire */
    /* Limits (store_config; docs/reliability.md); 0 = none, but for
     * max_reply_mb. */
    unsigned long max_daemon_mb, session_max_seqs, session_max_blocks, max_reply_mb;
    unsigned long ring_mb;     /* each session's step ring (ring.h) */
    unsigned long quant_group; /* the INT4 / INT2 tiers' group size (kernels.h) */
    char log_level[8];
    char backend[16];     /* backend.h: "host" (default), "shadow" (tests) or "cuda" */
    char cuda_device[48]; /* --backend cuda: "N" or "GPU-<uuid>" (default "0") */
    char cuda_ipc[8];     /* --backend cuda: "auto" (default), "vmm" or "legacy" */
    /* What a session that ended without a detach leaves: "free" (its blocks
     * at once), "quarantine" (its blocks once its process exited) or "auto"
     * (the default: quarantine on cuda, free on host and shadow);
     * config_lease_end_quarantine resolves it. */
    char lease_end[12];
    char move_priority[8];    /* one sequence's long work: background.h's names */
    char metrics[128];        /* HTTP /metrics address, "" = none */
    int metrics_allow_remote; /* serve /metrics on a non-loopback address */
    int dumpable;             /* stay dumpable (main.c: PR_SET_DUMPABLE), for debugging */
    unsigned long drain_ms;   /* NOT_SERVING this long before stopping */
    /* Sessions of these uids are operators' (store.h store_set_operators);
     * default root and the daemon's uid. */
    uid_t operator_uids[CONFIG_MAX_UIDS];
    size_t n_operator_uids;
    /* The remote tier (remote_tier.h, docs/remote.md): some of the Redis
     * Cluster's nodes ("" = none), the deployment's key namespace, the
     * values' time to live, a node's timeout and the probes' period. */
    char remote[192];
    char remote_namespace[65];
    unsigned long remote_ttl_s, remote_timeout_ms, remote_probe_ms;
    /* Spill on its own (spiller.h) below this percent of a pool's blocks
     * free; 0 = never. */
    unsigned long remote_spill_below;
    /* TLS on --listen (rpc.h rpc_tls): PEM paths, all three or none. */
    char tls_cert[PATH_MAX], tls_key[PATH_MAX], tls_client_ca[PATH_MAX];
} daemon_config;

/* One option: its key (as in the file; the flag is --key with '-'). */
typedef enum config_kind {
    CONFIG_PATH,
    CONFIG_ADDR,
    CONFIG_COUNT,
    CONFIG_BOOL,
    CONFIG_LEVEL,
    CONFIG_BACKEND,
    CONFIG_CUDA_DEVICE, /* an ordinal or a GPU UUID */
    CONFIG_CUDA_IPC,    /* auto, vmm or legacy */
    CONFIG_LEASE_END,   /* auto, free or quarantine */
    CONFIG_PRIORITY,    /* idle, low or normal (background.h) */
    CONFIG_UIDS,        /* a list of uids: "0,1000"; "" or "none" for none */
    CONFIG_FILE,        /* a file's path; "" or "off" for none */
    CONFIG_NODES,       /* host:port[,host:port...]; "" or "off" for none */
    CONFIG_NAME         /* 1-64 of A-Z a-z 0-9 _ . - */
} config_kind;

typedef struct config_option {
    const char *key; /* "pool-mb" */
    config_kind kind;
    unsigned long min, max; /* CONFIG_COUNT */
    const char *help;       /* one line for --help */
} config_option;

/* The options in --help and --print-config order; *count receives their number. */
const config_option *config_options(size_t *count);

/* Defaults: socket in $XDG_RUNTIME_DIR/kvstash or /run/kvstash, 256 MiB
 * pools, ... (kvstashd --help lists them). */
void config_defaults(daemon_config *c);

/*
 * Set option `key` ('-' or '_' between words) from text. Booleans take
 * true/false/yes/no/on/off/1/0; ADDR options take "" or "off" for none.
 * Returns 0, or -1 with a message naming the option and the allowed values
 * in err (unknown key, bad value).
 */
int config_set(daemon_config *c, const char *key, const char *value, char *err, size_t errlen);

/* Read an INI file over *c. Returns 0, or -1 with "FILE:LINE: message" (or
 * "cannot open FILE: reason") in err; *c may then be partly updated. */
int config_load(daemon_config *c, const char *path, char *err, size_t errlen);

/* Checks across options, after all of them are set: the TLS keys come all
 * three or none, and only with --listen (main.c then reads the files and
 * refuses --listen off loopback without them). Returns 0, or -1 with a
 * message in err. */
int config_check(const daemon_config *c, char *err, size_t errlen);

/* Whether lease-end resolves to quarantine for c's backend: "quarantine",
 * or "auto" with --backend cuda (docs/reliability.md, "Lease end"). */
int config_lease_end_quarantine(const daemon_config *c);

/* --move-priority as a background_priority. */
background_priority config_move_priority(const daemon_config *c);

/* Write *c as a config file that config_load reads back to the same values. */
void config_print(const daemon_config *c, const char *source, FILE *f);

#endif
