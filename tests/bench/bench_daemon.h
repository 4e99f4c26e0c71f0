/*
 * bench_daemon.h - what the daemon-level benchmarks (bench_rpc, bench_tiers)
 * share: a real kvstashd started on a socket in a fresh temporary directory
 * and stopped with SIGTERM, a monotonic clock, and medians.
 *
 * One daemon per process: the module keeps its pid and directory in statics
 * (benchmark code, not library code). Messages go to stderr prefixed with
 * the `prog` given to bench_daemon_start.
 */
#ifndef KVSTASH_BENCH_DAEMON_H
#define KVSTASH_BENCH_DAEMON_H

#include <stddef.h>

/* Latency of n calls, in microseconds. */
typedef struct bench_latency {
    size_t n;
    double p50_us, mean_us, p99_us;
} bench_latency;

/* CLOCK_MONOTONIC in microseconds. */
double bench_now_us(void);

/* Busy for `us` microseconds: a worker's forward pass between tokens, on a
 * thread that spins while it waits for its GPU. */
void bench_busy_us(double us);

/* Sorts v[0..n) in place; returns its median (v[n / 2]; 0 when n is 0). */
double bench_median(double *v, size_t n);

/* Sorts v[0..n) in place; fills p50, p99 and mean. */
bench_latency bench_summarize(double *v, size_t n);

/* The kvstashd to start: $KVSTASHD, else ../../daemon/kvstashd next to this
 * executable. Returns a static string. */
const char *bench_default_daemon(void);

#define BENCH_DAEMON_MAX_EXTRA 8

/* Start the kvstashd at `path` (--pool-mb pool_mb, --log-level warn, then
 * the NULL-terminated `extra` arguments, at most BENCH_DAEMON_MAX_EXTRA, or
 * none when NULL; stderr to kvstashd.log) on <tmpdir>/kvstashd.sock, written
 * to sock[socklen]; wait up to 10 s for the socket. Call before anything
 * starts threads (it forks). The daemon gets SIGTERM if this process dies.
 * Returns 0 or -1 (reported). */
int bench_daemon_start(const char *prog, const char *path, int pool_mb, const char *const *extra,
                       char *sock, size_t socklen);

/* SIGTERM the daemon and wait up to 10 s (then SIGKILL). Returns its exit
 * status, 0 if none was running, or -1 if it did not exit by itself. */
int bench_daemon_stop(void);

/* Stop the daemon and remove the temporary directory (for atexit). */
void bench_daemon_cleanup(void);

#endif
