/*
 * redis_cluster.h - the remote tier's store on a Redis Cluster: a small
 * cluster client over hiredis 0.14 (which has none) behind remote_store.h.
 *
 * Routing (Redis Cluster specification, "Key distribution model"): a key
 * belongs to slot CRC16(key) mod 16384, or CRC16 of its hash tag (the bytes
 * between the first '{' and the next '}', when there are any) so that keys
 * sharing a tag share a slot. The slot map comes from CLUSTER SLOTS; only
 * masters are read and written. Replicas' addresses are remembered too, so
 * that after a failover a refresh can still ask a live node (the promoted
 * one). One hiredis connection per node, opened on first use, each bounded
 * by timeout_ms (connect, and every read and write).
 *
 * A put, get or del of n keys is pipelined: its commands (SET key val
 * [EX ttl], GET key, DEL key) are grouped per node, all sent, then all
 * replies read. What the cluster answers:
 *   -MOVED slot h:p    the slot's owner is updated, a full CLUSTER SLOTS
 *                      refresh is scheduled, and the key is retried at h:p
 *   -ASK slot h:p      ASKING then the command at h:p; the map is unchanged
 *                      (at most 5 MOVED/ASK per key, then ST_UNAVAILABLE)
 *   -CLUSTERDOWN, -TRYAGAIN, -LOADING
 *                      refresh and retry after a short sleep, for at most
 *                      timeout_ms in all, then ST_UNAVAILABLE
 *   -OOM ...           ST_RESOURCE_EXHAUSTED (the node's maxmemory)
 *   other errors       ST_INTERNAL with the server's text
 * A node whose connection fails (refused, reset, EOF) is dropped, the map is
 * reloaded from any node that answers (known nodes, then the seeds) and the
 * call retried once; failing again, ST_UNAVAILABLE naming the node. A node
 * that does not answer within timeout_ms: ST_DEADLINE_EXCEEDED naming it,
 * its connection dropped (a half-read pipeline cannot be reused); the next
 * call reconnects. An answer of the wrong shape is ST_INTERNAL, never a
 * crash. A call that fails may have written or deleted some of its keys
 * (remote_store.h).
 *
 * ping PINGs every master of the map; when one does not answer or a slot
 * has no master, it reloads the map (a failover's promoted replica) and
 * PINGs the masters of the new one.
 *
 * Threads: every call (put, get, del, ping, health) holds the store's one
 * mutex for its whole length, so calls on one store are serialised; a slow
 * node stalls the other callers of the same store for up to its timeout
 * (and a topology refresh for up to one timeout per node it must try).
 * close must not race with any other call. SIGPIPE from a write to a dead
 * node is blocked in the calling thread during a call and discarded, so
 * the process need not ignore it.
 *
 * Memory: a call holds its whole pipeline (the formatted commands, every
 * value of a put) in memory while it runs.
 */
#ifndef KVSTASH_REDIS_CLUSTER_H
#define KVSTASH_REDIS_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "remote_store.h"
#include "status.h"

#define REDIS_CLUSTER_SLOTS 16384     /* slots of a Redis Cluster */
#define REDIS_CLUSTER_MAX_REDIRECTS 5 /* MOVED/ASK followed per key and call */

/* Open a store on the cluster that `seeds` belong to: "host:port" or
 * "host:port,host:port,..." (an IPv6 host in brackets, "[::1]:7000").
 * Asks the seeds in order for the slot map (CLUSTER SLOTS) and takes the
 * first that covers every slot, else the fullest; the other nodes are
 * connected on first use. timeout_ms (> 0) bounds each connect, each read
 * and each write, and a call's retries of a cluster that is down. On
 * success *out is the store (remote_close frees it) with ops name
 * "redis-cluster". A cluster whose map does not cover every slot yet opens
 * all the same (health's ok stays 0; keys of an uncovered slot fail with
 * ST_UNAVAILABLE).
 * Errors: ST_INVALID_ARGUMENT (seeds empty or an entry without a host or a
 * port in 1..65535, named; timeout_ms 0), ST_UNAVAILABLE (no seed answered;
 * names the seeds and the last error), ST_FAILED_PRECONDITION (a seed
 * answered but is not in cluster mode, and no other gave a map),
 * ST_INTERNAL (out of memory, or a CLUSTER SLOTS answer of the wrong
 * shape). */
status_code redis_cluster_open(const char *seeds, uint32_t timeout_ms, remote_store **out,
                               status *st);

/* The cluster slot of key[0..len): CRC16 (XMODEM: polynomial 0x1021, init 0)
 * of the key, or of its hash tag when the key has a non-empty one, mod
 * 16384. Binary-safe (len bytes, NULs included). */
uint16_t redis_cluster_key_slot(const char *key, size_t len);

#endif
