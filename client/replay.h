/*
 * replay.h - `kvstash replay`: run one eviction policy over a recorded trace,
 * offline, without a daemon (docs/replay.md has the trace format).
 *
 *   kvstash replay --policy NAME [--set key=value ...] [--layers N]
 *                  [--block-tokens B] [--q-heads Q] [--kv-heads H]
 *                  [--head-dim D] < trace.jsonl
 *
 * The trace is JSON Lines, one operation per line, applied in order to one
 * sequence through the policy host (policies/host.h), the same code the
 * daemon runs; each operation that has an answer writes one JSON line to
 * stdout. Defaults: 1 layer, 16 tokens per block, 1 query head, 1 KV head,
 * head dim 64.
 */
#ifndef KVSTASH_REPLAY_H
#define KVSTASH_REPLAY_H

#include <stdio.h>

/*
 * Run the command. argv[0] is the command's name (e.g. "replay" when the CLI
 * passes its sub-command's arguments, or the program name); the options
 * follow. Reads stdin, writes stdout, reports on stderr. Returns the exit
 * status: 0 ok, 1 a bad trace or invalid configuration (the message names
 * the line or the parameter), 2 a usage error.
 */
int replay_main(int argc, char **argv);

/* The same with explicit streams (for embedding and tests). */
int replay_run(int argc, char **argv, FILE *in, FILE *out, FILE *err);

#endif
