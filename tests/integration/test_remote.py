"""The remote tier (issue 17; docs/remote.md) against a real Redis Cluster.

The test starts a 3-master Redis Cluster with a replica each on loopback
ports (tests/remote/cluster.py: redis-server --cluster-enabled yes,
redis-cli --cluster create) and kvstashd with --remote pointing at two of
its nodes; a second kvstashd on the same cluster and namespace stands in for
another host.

* Health: Stats.remote, /metrics' kvstash_remote_* and /healthz report the
  cluster as the daemon's probe sees it (3 masters up, 16384 slots), and
  `kvstash status` prints it.
* Export and import: real workers (kvs_test_worker) hold sequences on
  daemon A; `kvstash seq export` writes one to the cluster, `kvstash seq
  import --session` rebuilds it in a worker session of daemon B: the same
  appended count, and per layer the same map of which positions are held in
  which tier (full, int8) as on A. The worker on A still verifies every
  token it holds. (kvstash-llama proves the imported K/V decode to the same
  log-likelihoods: test_llama_remote.)
* Sketches: a sequence whose victims are in its count-sketches
  (victims=sketch) moves with them (format 2: a sketch value per list): B
  holds the same map and appended count, and reserves its sketches' memory.
* Refusals: victims spilled to the remote tier (seq spill), an unknown uid,
  a malformed uid, a daemon without --remote: each a precise error, nothing
  changed.
* Faults: a value corrupted or deleted in the cluster makes the import fail
  with DATA_LOSS (never wrong K/V); a full cluster (maxmemory) refuses the
  export as RESOURCE_EXHAUSTED; a slow cluster (DEBUG SLEEP) makes the
  export fail with DEADLINE_EXCEEDED while another worker of the same daemon
  appends and steps undisturbed; a master killed while an import reads from
  it fails the import (UNAVAILABLE or DEADLINE_EXCEEDED, nothing imported),
  which works again after the failover; a killed master is replaced by its replica
  and the daemon recovers (probe failure, then healthy, export and import
  again); the whole cluster down leaves the daemon serving its workers,
  unhealthy in Stats, /metrics and /healthz, until the nodes come back.
* Bad flags: kvstashd refuses a malformed --remote or --remote-namespace
  (exit 2, the option named), and starts with a cluster that does not
  answer (unhealthy, UNAVAILABLE).
"""
import os
import subprocess
import sys
import threading
import time

from kvstash_harness import Daemon, call, pb, wait_until
from remote_cluster import RemoteCluster, cluster
from test_cli import Worker, fails, ok_json, run
from test_metrics import Scrape, http_get, metrics_port
from worker_procs import GEOMETRY, WorkerProc

KVSTASHD = os.environ.get("KVSTASHD", "")
RC = RemoteCluster("t")
CLUSTER_DIR = RC.dir
NAMESPACE = RC.ns
remote_args = RC.args
keys_of = RC.keys_of
owner_port = RC.owner_port


def remote_stats(daemon):
    st = daemon.stats()
    assert st.HasField("remote"), "Stats has no remote section"
    return st.remote


def wait_healthy(daemon, healthy=True, timeout=30):
    wait_until(lambda: remote_stats(daemon).healthy == healthy, timeout,
               f"the remote tier to be {'healthy' if healthy else 'unhealthy'} in Stats")
    return remote_stats(daemon)


def seq_of(daemon, session_id):
    ids = [q.seq_id for q in daemon.stats().sequences if q.session_id == session_id]
    assert len(ids) == 1, f"session {session_id} holds {ids}"
    return ids[0]


def session_of(worker):
    line = next((l for l in worker.lines if l.startswith("ATTACHED")), None)
    line = line or worker.wait_line("ATTACHED")
    return int(line.split()[1].split("=")[1])


def inspect(daemon, seq_id):
    return call(daemon.store.Inspect, pb.InspectRequest(seq_id=seq_id, with_map=True),
                what="Inspect")


def maps_of(r):
    return [(m.layer, m.head, [(t.first_position, t.count, t.tier) for t in m.runs])
            for m in r.maps]


def export(ctx, seq_id):
    j = ok_json(ctx, "seq", "export", str(seq_id))
    assert len(j["uid"]) == 32 and int(j["values"]) >= 2 and int(j["bytes"]) > 0, j
    assert j["key_prefix"] == f"kvs:{NAMESPACE}:{{default:{j['uid']}}}:", j
    return j




# ---- checks ------------------------------------------------------------------


def check_setup(ctx):
    ctx.daemons = []  # the other daemons a check starts


def check_stats_show_the_cluster_healthy(ctx):
    # On a loaded machine a node may miss the first probe's 500 ms (the
    # daemon drops its connection): the next probe, within 5 s, brings it back.
    wait_until(lambda: remote_stats(ctx.daemon).nodes_up == 3, 30,
               "the cluster's three masters to be up in Stats")
    r = wait_healthy(ctx.daemon)
    assert (r.backend, r.nodes, r.nodes_up, r.slots_covered) == ("redis-cluster", 3, 3, 16384), r
    assert r.key_namespace == NAMESPACE and r.seeds.startswith(f"127.0.0.1:{RC.ports[0]}"), r
    assert r.ttl_s == 86400 and r.timeout_ms == 500 and r.probes > 0, r
    assert r.last_ok_age_ms >= 0 and r.last_error == "", r


def check_metrics_healthz_and_status(ctx):
    ctx.port = metrics_port(ctx.daemon)
    s = Scrape(ctx.port)
    assert s.get("kvstash_remote_healthy") == 1
    assert s.get("kvstash_remote_nodes", state="total") == 3
    assert s.get("kvstash_remote_nodes", state="up") == 3
    assert s.get("kvstash_remote_slots_covered") == 16384
    assert s.get("kvstash_remote_probes_total") >= 1
    status, _, body = http_get(ctx.port, "/healthz")
    assert (status, body) == (200, "serving\nremote: healthy\n"), (status, body)
    rc, out, err = run(ctx, "status")
    assert rc == 0, err
    assert (f"remote: redis-cluster 127.0.0.1:{RC.ports[0]}" in out and
            f"namespace {NAMESPACE}: healthy, 3 of 3 nodes up, 16384 of 16384 slots" in out), out


def check_export_and_import_between_daemons(ctx):
    # Two sequences on A: streaming evicts (window), streaming with INT8
    # demotes; each goes to B, into a worker session of the same model.
    ctx.a1 = Worker(ctx.daemon, "rem-a1", 11, 96, step=4, policy="streaming",
                    params=["n_sink=4", "window=40"]).ready()
    ctx.a2 = Worker(ctx.daemon, "rem-a2", 12, 96, step=4, policy="streaming",
                    params=["n_sink=4", "window=64", "demote=int8", "int8_window=16"]).ready()
    ctx.b = Daemon(pool_mb=16, extra_args=remote_args()).start()
    ctx.daemons.append(ctx.b)
    wait_healthy(ctx.b)
    ctx.b1 = Worker(ctx.b, "rem-b1", 13, 8, policy="full").ready()
    b_session = session_of(ctx.b1)
    for w in (ctx.a1, ctx.a2):
        q = seq_of(ctx.daemon, session_of(w))
        j = export(ctx, q)
        before = inspect(ctx.daemon, q)
        imported = ok_json(ctx.b.sock, "seq", "import", j["uid"], "--session", str(b_session))
        r = inspect(ctx.b, int(imported["seq_id"]))
        assert int(imported["appended"]) == before.sequence.appended == r.sequence.appended == 96, \
            (imported, r.sequence)
        assert imported["policy"] == "streaming", imported
        assert ([(l.tokens, l.tokens_int8, l.blocks) for l in r.layers] ==
                [(l.tokens, l.tokens_int8, l.blocks) for l in before.layers]), (r.layers, before)
        assert {(p.key, p.value) for p in r.params} == {(p.key, p.value) for p in before.params}
        assert maps_of(r) == maps_of(before), f"maps differ:\n{maps_of(before)}\n{maps_of(r)}"
        tiers = {t.tier for m in r.maps for t in m.runs}
        assert "evicted" in tiers and ("int8" in tiers) == (w is ctx.a2), tiers
        assert int(j["blocks"]) == int(imported["blocks"]) > 0, (j, imported)
        # Keys live in one slot, with the daemon's time to live.
        keys = keys_of(j["uid"])
        assert len(keys) == int(j["values"]) and any(k.endswith(":manifest") for k in keys), keys
        assert len({cluster.key_slot(k) for k in keys}) == 1, keys
        ttl = cluster.call(owner_port(keys[0]), "TTL", keys[0])
        assert 86000 < ttl <= 86400, ttl
    # A's workers still hold and verify everything: export copied, changed nothing.
    for w in (ctx.a1, ctx.a2):
        w.proc.stdin.write("verify\n")
        w.proc.stdin.flush()
        assert "checked=" in w.wait_line("VERIFIED")
    r = remote_stats(ctx.daemon)
    assert r.bytes_written > 0 and r.calls > 0, r
    assert remote_stats(ctx.b).bytes_read > 0


def check_export_refusals(ctx):
    # Victims in the sketches (victims=sketch) move with them: the same map
    # on B, a sketch value per list, the sketches' memory reserved there.
    w = Worker(ctx.daemon, "rem-sketch", 14, 48, policy="streaming",
               params=["n_sink=4", "window=16", "victims=sketch"]).ready()
    q = seq_of(ctx.daemon, session_of(w))
    before = inspect(ctx.daemon, q)
    j = export(ctx, q)
    assert sum(k.endswith(".sketch") for k in keys_of(j["uid"])) == len(before.layers), \
        keys_of(j["uid"])
    imported = ok_json(ctx.b.sock, "seq", "import", j["uid"], "--session",
                       str(session_of(ctx.b1)))
    r = inspect(ctx.b, int(imported["seq_id"]))
    assert int(imported["appended"]) == before.sequence.appended == r.sequence.appended == 48, \
        (imported, r.sequence)
    assert maps_of(r) == maps_of(before), f"maps differ:\n{maps_of(before)}\n{maps_of(r)}"
    (moved,) = [s for s in ctx.b.stats().sequences if s.seq_id == int(imported["seq_id"])]
    assert moved.sketch_reserved_bytes > 0, moved
    # Once its victims are spilled to the remote tier it cannot move (yet).
    spilled = ok_json(ctx, "seq", "spill", str(q))
    assert int(spilled["spilled_tokens"]) > 0, spilled
    fails(ctx, 1, "spilled to the remote tier", "seq", "export", str(q))
    w.finish()
    # Before anything went to its sketch it moves, and reserves its sketches'
    # worst case on the importing daemon as a new sequence would.
    w = Worker(ctx.daemon, "rem-sketch2", 14, 8, policy="streaming",
               params=["n_sink=4", "window=16", "victims=sketch"]).ready()
    j = export(ctx, seq_of(ctx.daemon, session_of(w)))
    imported = ok_json(ctx.b.sock, "seq", "import", j["uid"], "--session",
                       str(session_of(ctx.b1)))
    (q,) = [s for s in ctx.b.stats().sequences if s.seq_id == int(imported["seq_id"])]
    assert q.sketch_reserved_bytes > 0 and q.appended == 8, q
    w.finish()
    b_session = session_of(ctx.b1)
    fails(ctx.b.sock, 4, "no exported sequence 0123456789abcdef0123456789abcdef",
          "seq", "import", "0123456789abcdef0123456789abcdef", "--session", str(b_session))
    fails(ctx.b.sock, 1, "lowercase hex digits", "seq", "import", "not-a-uid",
          "--session", str(b_session))
    fails(ctx, 4, "no sequence 999999", "seq", "export", "999999")
    plain = Daemon(pool_mb=16).start()
    ctx.daemons.append(plain)
    try:
        w = Worker(plain, "rem-plain", 15, 8).ready()
        fails(plain.sock, 1, "runs without a remote tier", "seq", "export",
              str(seq_of(plain, session_of(w))))
        assert not plain.stats().HasField("remote")
        w.finish()
    finally:
        plain.stop()


def check_corrupt_or_missing_value_is_data_loss(ctx):
    q = seq_of(ctx.daemon, session_of(ctx.a1))
    b_session = session_of(ctx.b1)
    j = export(ctx, q)
    data = [k for k in keys_of(j["uid"]) if not k.endswith(":manifest")]
    port = owner_port(data[0])
    cluster.call(port, "SETRANGE", data[0], "80", "X")  # a payload byte
    fails(ctx.b.sock, 1, "the manifest says", "seq", "import", j["uid"], "--session", str(b_session))
    j = export(ctx, q)
    data = [k for k in keys_of(j["uid"]) if not k.endswith(":manifest")]
    cluster.call(owner_port(data[-1]), "DEL", data[-1])
    fails(ctx.b.sock, 1, "is missing", "seq", "import", j["uid"], "--session", str(b_session))
    # Nothing was imported by either (the worker's own, two moved, two with
    # sketches reserved).
    assert len([s for s in ctx.b.stats().sequences if s.session_id == b_session]) == 5


def check_full_cluster_refuses_the_export(ctx):
    q = seq_of(ctx.daemon, session_of(ctx.a1))
    cluster.set_maxmemory(CLUSTER_DIR, 1)
    try:
        fails(ctx, 1, "remote tier: RESOURCE_EXHAUSTED", "seq", "export", str(q))
    finally:
        cluster.set_maxmemory(CLUSTER_DIR, 0)
    export(ctx, q)


def check_slow_cluster_times_out_without_stalling_others(ctx):
    q = seq_of(ctx.daemon, session_of(ctx.a1))
    # Longer than the probe that may hold the client when the export comes
    # (every master's timeout), and than the export's own timeout.
    sleepers = [threading.Thread(target=cluster.call, args=(p, "DEBUG", "SLEEP", "6"),
                                 kwargs={"timeout": 15})
                for p in cluster.masters(CLUSTER_DIR)]
    for t in sleepers:
        t.start()
    time.sleep(0.2)
    try:
        # A worker appends and steps on the same daemon while the export waits.
        w = WorkerProc(ctx.daemon, "rem-busy", 16, 64, policy="streaming",
                       params=["window=16"], model="cli", geometry=GEOMETRY)
        fails(ctx, 1, "remote tier: DEADLINE_EXCEEDED", "seq", "export", str(q))
        w.finish()
    finally:
        for t in sleepers:
            t.join()
    assert remote_stats(ctx.daemon).timeouts > 0
    wait_healthy(ctx.daemon)


def check_master_killed_during_import(ctx):
    # The import is reading from the master when it dies (it hangs in DEBUG
    # SLEEP first, so that the read is in flight): the import fails with the
    # remote tier's code and imports nothing; after the failover it works.
    q = seq_of(ctx.daemon, session_of(ctx.a1))
    j = export(ctx, q)
    cluster.sync_replicas(CLUSTER_DIR)
    dead = owner_port(keys_of(j["uid"])[0])
    b_session = session_of(ctx.b1)
    before = len([s for s in ctx.b.stats().sequences if s.session_id == b_session])

    RC.cli_in_flight(dead, run, ctx.b.sock, "seq", "import", j["uid"], "--session",
                     str(b_session))
    assert len([s for s in ctx.b.stats().sequences if s.session_id == b_session]) == before
    cluster.wait_failover(CLUSTER_DIR, dead, timeout=30)
    wait_healthy(ctx.b)
    imported = ok_json(ctx.b.sock, "seq", "import", j["uid"], "--session", str(b_session))
    assert maps_of(inspect(ctx.b, int(imported["seq_id"]))) == maps_of(inspect(ctx.daemon, q))
    cluster.rejoin(CLUSTER_DIR, dead)
    wait_healthy(ctx.daemon)


def check_killed_master_fails_over(ctx):
    q = seq_of(ctx.daemon, session_of(ctx.a1))
    probes = remote_stats(ctx.daemon).probe_failures
    dead = cluster.masters(CLUSTER_DIR)[0]
    cluster.kill(CLUSTER_DIR, dead)
    ctx.killed = dead
    wait_until(lambda: remote_stats(ctx.daemon).probe_failures > probes, 20,
               "a probe to notice the dead master")
    cluster.wait_failover(CLUSTER_DIR, dead, timeout=30)
    r = wait_healthy(ctx.daemon)
    assert r.nodes == 3 and r.nodes_up == 3 and r.refreshes > 0, r
    j = export(ctx, q)
    b_session = session_of(ctx.b1)
    ok_json(ctx.b.sock, "seq", "import", j["uid"], "--session", str(b_session))


def check_cluster_down_daemon_keeps_serving(ctx):
    q = seq_of(ctx.daemon, session_of(ctx.a1))
    live = cluster.live_ports(CLUSTER_DIR)
    for p in live:
        cluster.kill(CLUSTER_DIR, p)
    r = wait_healthy(ctx.daemon, healthy=False)
    assert r.last_error != "", r
    status, _, body = http_get(ctx.port, "/healthz")
    assert status == 200 and body.startswith("serving\nremote: unhealthy: "), (status, body)
    assert Scrape(ctx.port).get("kvstash_remote_healthy") == 0
    w = WorkerProc(ctx.daemon, "rem-down", 17, 64, policy="streaming", params=["window=16"],
                   model="cli", geometry=GEOMETRY)
    fails(ctx, 1, "remote tier: UNAVAILABLE", "seq", "export", str(q))
    assert w.finish()["ok"] is True
    for p in live + [ctx.killed]:
        cluster.restart(CLUSTER_DIR, p)
    cluster.wait_ok(CLUSTER_DIR, timeout=30)
    wait_healthy(ctx.daemon, timeout=40)
    export(ctx, q)


def check_bad_flags(ctx):
    for args, needle in [(["--remote", "nohost"], "remote must be host:port"),
                         (["--remote", "127.0.0.1:70000"], "remote must be host:port"),
                         (["--remote", "127.0.0.1:7000,"], "ends with a comma"),
                         (["--remote-namespace", "a b"], "remote-namespace must be"),
                         (["--remote-timeout-ms", "0"], "remote-timeout-ms must be")]:
        p = subprocess.run([KVSTASHD, "--socket", "/tmp/never.sock", *args],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and needle in p.stderr, (args, p.returncode, p.stderr)
    d = Daemon(pool_mb=16, extra_args=["--remote", "127.0.0.1:1", "--remote-probe-ms", "100"])
    d.start()
    ctx.daemons.append(d)
    try:
        r = remote_stats(d)
        assert not r.healthy and not r.connected and "UNAVAILABLE" in r.last_error, r
    finally:
        d.stop()


def check_workers_finish(ctx):
    for w in (ctx.a1, ctx.a2, ctx.b1):
        assert w.finish()["ok"] is True
    ctx.b.stop()


def main():
    return RC.run("test_remote", [
        check_setup,
        check_stats_show_the_cluster_healthy,
        check_metrics_healthz_and_status,
        check_export_and_import_between_daemons,
        check_export_refusals,
        check_corrupt_or_missing_value_is_data_loss,
        check_full_cluster_refuses_the_export,
        check_slow_cluster_times_out_without_stalling_others,
        check_master_killed_during_import,
        check_killed_master_fails_over,
        check_cluster_down_daemon_keeps_serving,
        check_bad_flags,
        check_workers_finish,
    ], ["--metrics", "127.0.0.1:0"])


if __name__ == "__main__":
    sys.exit(main())
