"""test_hostile_stall.py - issue 12, problem 4: one call must not stall everyone.

  0. Both run while a long sequence (65,536 tokens x 32 layers) is held.
  1. An operator's offload (Evict to "sketch") over a long sequence of one
     model, while a worker of another model appends one token at a time: the
     offload is done a chunk of layers at a time with the store's lock let go
     in between, so the appends keep going and none waits for the whole call.
     Before the change the call held the lock throughout (2 M list tokens: 2
     to 4 s here) and the append that came in waited all of it.
  2. A flood of Stats with_tiers from several threads while a worker reads
     its block table: the table reads stay within a few times their quiet
     latency. Stats is served from a shared snapshot, rebuilt under the lock
     only when something changed since the last (reads change nothing);
     before, every call walked every list's segments under the lock (2 M
     tokens: a few ms each), and the reads queued behind them.

The figures (p50/p99/max, in ms) are printed; the bounds are ratios or
generous, for a loaded 2-core CI machine.
"""
import os
import threading
import time

from kvstash_harness import Worker, call, geometry, pb, run_tests

LAYERS = 32
TOKENS = 65536  # x 32 layers: 2 M list tokens, 256 MiB of fp32 K/V
APPEND_STEP = 16384  # an Append's reply lists every layer's writes: keep it small
FLOOD_THREADS = 6


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else 0.0


def figures(xs):
    return (f"n={len(xs)} p50={pct(xs, 50) * 1e3:.2f} p99={pct(xs, 99) * 1e3:.2f} "
            f"max={max(xs, default=0) * 1e3:.2f} ms")


def streaming_seq(d, w, tokens, step):
    req = pb.CreateSequenceRequest(policy="streaming",
                                   params=[pb.Param(key="window", value="1048576")])
    seq_id = call(d.store.CreateSequence, req, w.md, "CreateSequence").seq_id
    left = tokens
    while left > 0:
        n = min(left, step)
        d.store.Append(pb.AppendRequest(seq_id=seq_id, count=n), metadata=w.md, timeout=60)
        left -= n
    return seq_id


def setup(ctx):
    d = ctx.daemon
    ctx.big, ctx.small = Worker(d), Worker(d)
    ctx.workers = [ctx.big, ctx.small]
    ctx.big.attach("big-model", geometry(layers=LAYERS, kv_heads=2, head_dim=8), name="big")
    ctx.small.attach("small-model", geometry(), name="small")
    ctx.big_seq = streaming_seq(d, ctx.big, TOKENS, APPEND_STEP)
    ctx.small_seq = streaming_seq(d, ctx.small, 16, 16)


class Timed(threading.Thread):
    """Calls fn() in a loop until stopped, recording (start, latency)."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.stop, self.samples, self.error = fn, threading.Event(), [], None

    def run(self):
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                self.fn()
                self.samples.append((t0, time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - reported by the check
            self.error = e

    def finish(self):
        self.stop.set()
        self.join(30)
        assert not self.is_alive(), "a timed caller did not finish within 30 s"
        assert self.error is None, f"a timed call failed: {self.error!r}"
        return self.samples


def check_offload_does_not_stall_another_model(ctx):
    d, small = ctx.daemon, ctx.small

    def append_one():
        d.store.Append(pb.AppendRequest(seq_id=ctx.small_seq, count=1), metadata=small.md,
                       timeout=60)

    quiet = Timed(append_one)
    quiet.start()
    time.sleep(0.5)
    quiet_lat = [x for _, x in quiet.finish()]
    before = call(d.store.GetBlockTable, pb.GetBlockTableRequest(seq_id=ctx.big_seq), ctx.big.md)
    busy = Timed(append_one)
    busy.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    r = d.store.Evict(pb.EvictRequest(seq_id=ctx.big_seq, to="sketch",
                                      ranges=[pb.PositionRange(first=0, count=TOKENS)]),
                      metadata=ctx.big.md, timeout=120)
    t1 = time.monotonic()
    time.sleep(0.1)
    samples = busy.finish()
    # Appends that overlapped the offload (started before it ended, ended
    # after it started).
    during = [x for s, x in samples if s < t1 and s + x > t0]
    dur = t1 - t0
    print(f"  offload of {TOKENS} x {LAYERS} list tokens: {dur * 1e3:.0f} ms, "
          f"epoch {before.epoch} -> {r.epoch}", flush=True)
    print(f"  another model's 1-token appends, quiet:  {figures(quiet_lat)}", flush=True)
    print(f"  another model's 1-token appends, during: {figures(during)}", flush=True)
    assert r.requested == TOKENS * LAYERS and r.moved == TOKENS * LAYERS, str(r)
    # Before the change the append that came in waited the whole call.
    bound = max(0.25 * dur, 0.1)
    assert max(during) <= bound, (f"an append of another model waited {max(during) * 1e3:.0f} "
                                  f"ms during a {dur * 1e3:.0f} ms offload "
                                  f"(bound {bound * 1e3:.0f} ms)")
    assert len(during) >= 5, f"only {len(during)} appends of another model during the offload"
    # Each chunk is its own epoch: more than one means the call let go.
    assert r.epoch - before.epoch >= 2, \
        f"one epoch for the whole offload: {before.epoch} -> {r.epoch}"
    # Everything moved, every list's tokens now in the sketch.
    st = call(d.store.Stats, pb.StatsRequest(with_tiers=True), ctx.big.md)
    mine = [q for q in st.sequences if q.seq_id == ctx.big_seq][0]
    tiers = {t.tier: t.tokens for t in mine.tiers}
    assert tiers["sketch"] == TOKENS * LAYERS and tiers["full"] == 0, str(tiers)


def check_stats_flood_does_not_slow_table_reads(ctx):
    setup(ctx)
    d, small = ctx.daemon, ctx.small

    def read_table():
        d.store.GetBlockTable(pb.GetBlockTableRequest(seq_id=ctx.small_seq), metadata=small.md,
                              timeout=60)

    def stats():
        d.store.Stats(pb.StatsRequest(with_tiers=True), metadata=ctx.big.md, timeout=60)

    quiet = Timed(read_table)
    quiet.start()
    time.sleep(1.0)
    quiet_lat = [x for _, x in quiet.finish()]
    flood = [Timed(stats) for _ in range(FLOOD_THREADS)]
    for f in flood:
        f.start()
    time.sleep(0.3)
    reads = Timed(read_table)
    reads.start()
    time.sleep(1.5)
    busy_lat = [x for _, x in reads.finish()]
    nstats = sum(len(f.finish()) for f in flood)
    print(f"  table reads, quiet:              {figures(quiet_lat)}", flush=True)
    print(f"  table reads, {FLOOD_THREADS} threads of Stats: {figures(busy_lat)} "
          f"({nstats} Stats answered)", flush=True)
    assert nstats >= FLOOD_THREADS, f"the Stats flood got {nstats} answers"
    assert busy_lat, "no table read was answered during the Stats flood"
    # Before the change: p50 0.24 -> 24 ms, p99 0.34 -> 49 ms.
    # Under a sanitizer the figures measure the sanitizer, not the lock: on CI's
    # two cores six TSan-slowed Stats threads starve the reader of CPU (p50
    # 213 ms with no lock held). The bounds are judged in plain builds only.
    if os.environ.get("KVSTASH_SANITIZE") == "1":
        print("  (sanitized build: latency bounds judged in plain builds only)", flush=True)
        return
    for p, slack in ((50, 0.005), (99, 0.025)):
        bound = 5 * pct(quiet_lat, p) + slack
        assert pct(busy_lat, p) <= bound, (f"table read p{p} {pct(busy_lat, p) * 1e3:.2f} ms under "
                                           f"a Stats flood, bound {bound * 1e3:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(run_tests("test_hostile_stall", [
        check_stats_flood_does_not_slow_table_reads,
        check_offload_does_not_stall_another_model,
    ], daemon_kwargs={"pool_mb": 512, "log_level": "info"}, time_limit=120))
