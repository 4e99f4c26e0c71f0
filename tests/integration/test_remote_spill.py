"""Spill and revive through the remote tier (issue 17; docs/remote.md
"Spill and revive") against a real Redis Cluster.

The test starts a 3-master Redis Cluster with a replica each on loopback
ports (tests/remote/cluster.py) and kvstashd with --remote. The workers are
kvs_tier_worker: a streaming sequence with victims=int8 (evicted tokens kept
revivable in INT8 blocks) of seeded fp16 K/V; between rounds (--on-input)
the test acts, then the worker appends a token and revives every layer,
checking every position against what it wrote (INT8 within its bound).

* Sketches: with victims=sketch the spill moves each layer's count-sketch
  (victims only) to the cluster and frees it; new victims start fresh
  sketches, which a second spill takes too; every Revive reads each victim
  from the sketch it went into, and the worker checks the estimates (with
  --exact, equal to what it wrote).
* Spill: `kvstash seq spill` moves the victim blocks to the cluster: the
  pool gets exactly those blocks back, Stats and /metrics count the spilled
  victims and bytes, the values live in one slot with the daemon's time to live; the
  next round's Revive brings every victim back from the cluster (the
  worker's checks pass, the remote tier read bytes). A spill with nothing
  to spill spills nothing; export refuses a sequence with spilled victims;
  when the sequence ends, its values are deleted.
* On its own: with --remote-spill-below, memory pressure spills the
  victims without being asked, and they revive from the cluster.
* Faults: a spilled value corrupted or deleted in the cluster makes the
  Revive fail with DATA_LOSS (never wrong K/V) and the daemon serves on; a
  full cluster (maxmemory) refuses the spill as RESOURCE_EXHAUSTED and
  nothing changes (the victims revive from the pool); a slow cluster makes
  the spill fail with DEADLINE_EXCEEDED, nothing changed; a master killed
  after the spill is replaced by its replica and the Revive finds the
  victims there; a master killed while a Revive reads from it fails that
  Revive with UNAVAILABLE or DEADLINE_EXCEEDED, and after the failover
  spill and revive work again; a master killed while a spill writes to it
  fails the spill and changes nothing; a daemon without --remote refuses.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

from kvstash_harness import Daemon, wait_until
from remote_cluster import RemoteCluster, assert_remote_down, cluster
from test_cli import fails, ok_json, ok_text, run
from test_metrics import Scrape, metrics_port

TIER_WORKER = os.environ.get("KVSTASH_TIER_WORKER", "")
RC = RemoteCluster("s")
CLUSTER_DIR = RC.dir
NAMESPACE = RC.ns
remote_args = RC.args
keys_of = RC.keys_of
owner_port = RC.owner_port


class TierWorker:
    """kvs_tier_worker, one round per line written to its stdin."""

    def __init__(self, daemon, rounds=4, tokens=200, victims="int8"):
        exact = ["--exact"] if victims == "sketch" else []
        self.proc = subprocess.Popen(
            [TIER_WORKER, "--socket", daemon.sock, "--victims", victims, "--tokens", str(tokens),
             "--window", "16", "--rounds", str(rounds), "--on-input", *exact],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.seq, self.int8, self.sketch = self.wait_round(0)

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.strip())
                self.cv.notify_all()
        with self.cv:
            self.lines.append(None)
            self.cv.notify_all()

    def wait_round(self, n, timeout=60):
        """(seq, tokens revived from INT8, from a sketch) of ROUND n."""
        want = f"ROUND {n} "
        with self.cv:
            ok = self.cv.wait_for(lambda: None in self.lines or
                                  any(l and l.startswith(want) for l in self.lines), timeout)
            line = next((l for l in self.lines if l and l.startswith(want)), None)
        if line is None:
            self.proc.wait(timeout=10)
            raise AssertionError(f"kvs_tier_worker: no {want.strip()} (waited: {ok}), exit "
                                 f"{self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
        f = dict(kv.split("=") for kv in line.split()[2:])
        return int(f["seq"]), int(f["int8"]), int(f["sketch"])

    def step(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, code=0):
        """Close stdin; the worker's exit code must be `code`. Returns stderr."""
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        err = self.proc.stderr.read()
        assert self.proc.returncode == code, \
            f"kvs_tier_worker: exit {self.proc.returncode}, want {code}: {err[-2000:]}"
        if code == 0:
            with self.cv:  # every line read
                self.cv.wait_for(lambda: None in self.lines, 10)
                done = [l for l in self.lines if l and l.startswith("{\"ok\"")]
            assert done and json.loads(done[-1])["ok"], self.lines[-3:]
        return err


def seq_stats(daemon, seq_id):
    (q,) = [s for s in daemon.stats().sequences if s.seq_id == seq_id]
    return q


def blocks_free(daemon):
    (p,) = daemon.stats().pools
    return p.blocks_free, p.block_bytes


def spill(ctx, seq_id, daemon=None):
    return ok_json((daemon or ctx.daemon).sock, "seq", "spill", str(seq_id))




# ---- checks ------------------------------------------------------------------


def check_spill_frees_blocks_and_revive_fetches(ctx):
    w = TierWorker(ctx.daemon)
    assert w.int8 > 0, "round 0 revived no INT8 victim"
    free0, block_bytes = blocks_free(ctx.daemon)
    read0 = ctx.daemon.stats().remote.bytes_read
    j = spill(ctx, w.seq)
    blocks, tokens = int(j["blocks"]), int(j["tokens"])
    assert blocks > 0 and tokens > 0 and int(j["values"]) == blocks, j
    assert int(j["spilled_tokens"]) == tokens and int(j.get("dropped", 0)) == 0, j
    assert j["key_prefix"] == f"kvs:{NAMESPACE}:{{default:{j['uid']}}}:", j
    free1, _ = blocks_free(ctx.daemon)
    assert free1 == free0 + blocks, (free0, free1, blocks)
    q = seq_stats(ctx.daemon, w.seq)
    assert q.spilled_tokens == tokens and q.spilled_bytes == blocks * block_bytes, q
    m = Scrape(metrics_port(ctx.daemon))
    assert m.get("kvstash_remote_spilled_tokens") == tokens, m.get("kvstash_remote_spilled_tokens")
    assert m.get("kvstash_remote_spilled_bytes") == blocks * block_bytes
    head, *rows = ok_text(ctx, "seqs").splitlines()
    (row,) = [r.split() for r in rows if r.split()[0] == str(w.seq)]
    assert row[head.split().index("REMOTE")] == str(tokens), (head, row)
    keys = keys_of(j["uid"])
    assert len(keys) == blocks and all(k.startswith(j["key_prefix"] + "v") for k in keys), keys
    assert len({cluster.key_slot(k) for k in keys}) == 1, keys
    ttl = cluster.call(owner_port(keys[0]), "TTL", keys[0])
    assert 86000 < ttl <= 86400, ttl
    # The next round revives every layer: the spilled victims come back from
    # the cluster, and the worker checks each against what it wrote.
    w.step()
    _, int8, _ = w.wait_round(1)
    assert int8 >= w.int8, (int8, w.int8)
    assert ctx.daemon.stats().remote.bytes_read > read0
    # Spilled victims stay where they are: spilling again moves only new
    # victim blocks, and export cannot carry the sequence.
    j2 = spill(ctx, w.seq)
    assert j2["uid"] == j["uid"] and int(j2.get("spilled_tokens", 0)) >= tokens, j2
    fails(ctx, 1, "spilled to the remote tier", "seq", "export", str(w.seq))
    w.step()
    w.wait_round(2)
    w.finish()
    # The sequence ended: its values are deleted after the next probe.
    wait_until(lambda: keys_of(j["uid"]) == [], 20, "the ended sequence's values to go")


def check_sketches_spill_and_revive(ctx):
    # victims=sketch: each layer's count-sketch holds only victims; the
    # spill freezes it in the cluster and frees it, new victims start a
    # fresh one, and a Revive reads each victim from the sketch it went
    # into (the worker checks every estimate: with --exact, the bytes it
    # wrote).
    w = TierWorker(ctx.daemon, victims="sketch")
    assert w.sketch > 0, "round 0 revived nothing from a sketch"
    j = spill(ctx, w.seq)
    assert int(j.get("blocks", 0)) == 0 and int(j["sketches"]) == 2, j  # one list a layer
    assert int(j["tokens"]) > 0 and int(j["values"]) == 2, j
    q = seq_stats(ctx.daemon, w.seq)
    assert q.spilled_tokens == int(j["tokens"]) and q.spilled_bytes > 0, q
    w.step()
    _, _, sketch = w.wait_round(1)
    assert sketch >= w.sketch, (sketch, w.sketch)
    # The round's victims went into fresh sketches: a second spill takes
    # them, and the next Revive reads from both spilled generations.
    j2 = spill(ctx, w.seq)
    assert int(j2["sketches"]) == 2 and int(j2["spilled_tokens"]) > int(j["tokens"]), j2
    w.step()
    _, _, sketch = w.wait_round(2)
    assert sketch > w.sketch
    assert len(keys_of(j["uid"])) == 4
    w.finish()
    wait_until(lambda: keys_of(j["uid"]) == [], 20, "the ended sequence's values to go")


def check_memory_pressure_spills_on_its_own(ctx):
    # --remote-spill-below 95: once fewer than 95% of the pool's 1024 blocks
    # are free, kvstashd spills the victims itself; the worker's next round
    # revives them from the cluster and checks them.
    d = Daemon(pool_mb=1, extra_args=remote_args(["--remote-spill-below", "95"])).start()
    try:
        w = TierWorker(d, tokens=400)
        wait_until(lambda: seq_stats(d, w.seq).spilled_tokens > 0, 20,
                   "kvstashd to spill the victims on its own")
        w.step()
        _, int8, _ = w.wait_round(1)
        assert int8 >= w.int8
        w.finish()
        assert "spill_pressured" in d.log(), d.log_tail()
    finally:
        d.stop()


def check_nothing_to_spill(ctx):
    w = TierWorker(ctx.daemon, tokens=12)  # within the window: no victim yet
    j = spill(ctx, w.seq)
    assert int(j.get("blocks", 0)) == 0 and int(j.get("spilled_tokens", 0)) == 0, j
    fails(ctx, 4, "no sequence 999999", "seq", "spill", "999999")
    fails(ctx, 2, "seq spill", "seq", "spill", "not-a-number")
    w.finish()


def check_corrupt_or_missing_value_is_data_loss(ctx):
    for how, needle in (("corrupt", "checksum"), ("missing", "is missing")):
        w = TierWorker(ctx.daemon)
        j = spill(ctx, w.seq)
        key = keys_of(j["uid"])[0]
        if how == "corrupt":
            cluster.call(owner_port(key), "SETRANGE", key, "200", "X")  # a payload byte
        else:
            cluster.call(owner_port(key), "DEL", key)
        w.step()
        err = w.finish(code=2)
        # libkvstash's KVS_ERR_DATA_LOSS, the daemon's message behind it (after the
        # call's name when the Revive went through the session's ring)
        assert re.search(r"data lost in the remote tier \((Revive: )?remote tier: ", err), err
        assert needle in err, (needle, err)
    assert ctx.daemon.stats().serving  # and the daemon serves on


def check_full_cluster_refuses_the_spill(ctx):
    w = TierWorker(ctx.daemon)
    free0, _ = blocks_free(ctx.daemon)
    cluster.set_maxmemory(CLUSTER_DIR, 1)
    try:
        fails(ctx, 1, "remote tier: RESOURCE_EXHAUSTED", "seq", "spill", str(w.seq))
    finally:
        cluster.set_maxmemory(CLUSTER_DIR, 0)
    assert blocks_free(ctx.daemon)[0] == free0
    assert seq_stats(ctx.daemon, w.seq).spilled_tokens == 0
    w.step()
    w.wait_round(1)  # the victims revive from the pool
    assert int(spill(ctx, w.seq)["blocks"]) > 0
    w.step()
    w.wait_round(2)
    w.finish()


def check_slow_cluster_times_out(ctx):
    w = TierWorker(ctx.daemon)
    free0, _ = blocks_free(ctx.daemon)
    # Longer than the probe that may hold the client when the spill comes
    # (every master's timeout, then a refresh), and than the spill's own.
    sleepers = [threading.Thread(target=cluster.call, args=(p, "DEBUG", "SLEEP", "6"),
                                 kwargs={"timeout": 15})
                for p in cluster.masters(CLUSTER_DIR)]
    for t in sleepers:
        t.start()
    time.sleep(0.2)
    try:
        fails(ctx, 1, "remote tier: DEADLINE_EXCEEDED", "seq", "spill", str(w.seq))
    finally:
        for t in sleepers:
            t.join()
    assert blocks_free(ctx.daemon)[0] == free0
    assert seq_stats(ctx.daemon, w.seq).spilled_tokens == 0
    w.step()
    w.wait_round(1)
    w.finish()


def check_killed_master_fails_over(ctx):
    w = TierWorker(ctx.daemon)
    j = spill(ctx, w.seq)
    key = keys_of(j["uid"])[0]
    cluster.sync_replicas(CLUSTER_DIR)
    dead = owner_port(key)
    cluster.kill(CLUSTER_DIR, dead)
    cluster.wait_failover(CLUSTER_DIR, dead, timeout=30)
    wait_until(lambda: ctx.daemon.stats().remote.healthy, 30, "the remote tier to be healthy")
    w.step()
    _, int8, _ = w.wait_round(1)  # from the promoted replica
    assert int8 >= w.int8
    w.finish()
    rejoin(dead)


def rejoin(dead):
    cluster.rejoin(CLUSTER_DIR, dead)


def check_master_killed_during_revive(ctx):
    # The Revive is fetching from the master when it dies (it hangs in DEBUG
    # SLEEP first, so that the read is in flight): the Revive fails with the
    # remote tier's code, the worker's other calls were never held up, and
    # once the replica took over, spill and revive work again.
    w = TierWorker(ctx.daemon)
    j = spill(ctx, w.seq)
    dead = owner_port(keys_of(j["uid"])[0])
    cluster.sync_replicas(CLUSTER_DIR)

    assert_remote_down(RC.kill_in_flight(dead, lambda: (w.step(), lambda: w.finish(code=2))[1]))
    cluster.wait_failover(CLUSTER_DIR, dead, timeout=30)
    wait_until(lambda: ctx.daemon.stats().remote.healthy, 30, "the remote tier to be healthy")
    w = TierWorker(ctx.daemon)
    assert int(spill(ctx, w.seq)["blocks"]) > 0
    w.step()
    w.wait_round(1)
    w.finish()
    rejoin(dead)


def check_master_killed_during_spill(ctx):
    # A first spill gives the sequence its keys' slot; a dozen rounds later
    # new victim blocks wait, and the slot's master hangs (DEBUG SLEEP) so
    # that the second spill's write is in flight when it is killed. That
    # spill fails with the remote tier's code and changes nothing (the
    # victims revive from the pool); after the failover it works.
    w = TierWorker(ctx.daemon, rounds=20)
    j = spill(ctx, w.seq)
    dead = owner_port(keys_of(j["uid"])[0])
    for r in range(1, 15):
        w.step()
        w.wait_round(r)
    before = seq_stats(ctx.daemon, w.seq).spilled_tokens
    free0, _ = blocks_free(ctx.daemon)
    cluster.sync_replicas(CLUSTER_DIR)
    RC.cli_in_flight(dead, run, ctx.daemon.sock, "seq", "spill", str(w.seq), pause=0.3)
    assert blocks_free(ctx.daemon)[0] == free0
    assert seq_stats(ctx.daemon, w.seq).spilled_tokens == before
    cluster.wait_failover(CLUSTER_DIR, dead, timeout=30)
    wait_until(lambda: ctx.daemon.stats().remote.healthy, 30, "the remote tier to be healthy")
    w.step()
    w.wait_round(15)  # every victim still revives (the first spill's from the replica)
    assert int(spill(ctx, w.seq)["spilled_tokens"]) > before
    w.step()
    w.wait_round(16)
    w.finish()
    rejoin(dead)


def check_without_remote_tier(ctx):
    plain = Daemon(pool_mb=16).start()
    try:
        w = TierWorker(plain)
        fails(plain.sock, 1, "runs without a remote tier", "seq", "spill", str(w.seq))
        w.step()
        w.wait_round(1)
        w.finish()
    finally:
        plain.stop()


def main():
    return RC.run("test_remote_spill", [
        check_spill_frees_blocks_and_revive_fetches,
        check_sketches_spill_and_revive,
        check_memory_pressure_spills_on_its_own,
        check_nothing_to_spill,
        check_corrupt_or_missing_value_is_data_loss,
        check_full_cluster_refuses_the_spill,
        check_slow_cluster_times_out,
        check_killed_master_fails_over,
        check_master_killed_during_revive,
        check_master_killed_during_spill,
        check_without_remote_tier,
    ], ["--metrics", "127.0.0.1:0"])


if __name__ == "__main__":
    sys.exit(main())
