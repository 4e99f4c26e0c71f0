#!/usr/bin/env python3
"""test_hostile_limits.py - issue 12, problems 2 and 4 (the reply): what one
worker's requests may make kvstashd allocate is bounded and accounted, and a
request over a limit is refused before it changes anything.

  - sketch_rows/sketch_buckets at their largest on a small pool: refused at
    CreateSequence (RESOURCE_EXHAUSTED naming --max-daemon-mb) instead of
    growing the daemon by gigabytes; the daemon's VmRSS stays bounded while a
    worker with an accepted sketch sequence appends and steps;
  - per-session quotas (--session-max-seqs, --session-max-blocks): a session
    cannot pass them, another session is unaffected;
  - an Append whose reply would pass the reply limit (--max-reply-mb, 64 MiB
    by default) is refused and appends nothing; the split it suggests works.
"""
import os
import re
import subprocess
import sys
import time
import urllib.request

import grpc

from kvstash_harness import (Daemon, Worker, call, expect_status, geometry, pb, pb_grpc,
                             run_tests)

C = grpc.StatusCode
MIB = 1 << 20
# The daemon may grow this much over its RSS at start while the checks run:
# what an accepted sketch sequence of the default geometry takes, with room
# (under ASan, whose quarantine keeps up to 256 MiB of freed memory, more).
# Before the budget, one sequence of the largest sketch allocated 2.1 GiB.
RSS_GROWTH_BOUND = (1024 if os.environ.get("KVSTASH_SANITIZE") == "1" else 256) * MIB


def vm_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def worker(ctx, geom=None, name="limits", daemon=None):
    w = Worker(daemon or ctx.daemon)
    if daemon is None:
        ctx.workers.append(w)
    w.attach(model=f"m{geom.layers if geom else 2}", geom=geom, name=name)
    return w


def params(**kv):
    return [pb.Param(key=k, value=str(v)) for k, v in kv.items()]


def create(d, w, policy="streaming", **kv):
    return d.store.CreateSequence(pb.CreateSequenceRequest(policy=policy, params=params(**kv)),
                                  timeout=10, metadata=w.md)


def append(d, w, seq, count, ack=0):
    return call(d.store.Append, pb.AppendRequest(seq_id=seq, count=count, ack_epoch=ack), w.md,
                f"Append {count}")


def seq_stats(d, seq):
    for q in d.stats().sequences:
        if q.seq_id == seq:
            return q
    raise AssertionError(f"sequence {seq} not in Stats")


def metrics_text(d, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"msg=metrics_listening addr=[0-9.]+:(\d+)", d.log())
        if m:
            with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=5) as r:
                return r.read().decode()
        time.sleep(0.05)
    raise AssertionError("no metrics_listening line in the log")


def check_setup(ctx):
    ctx.workers = []
    ctx.rss0 = vm_rss(ctx.daemon.proc.pid)


def check_largest_sketch_refused_at_create(ctx):
    """Problem 2: 8 layers x 32 rows x 65536 buckets x (2 x 16 floats) is
    2.2 GB of sketch cells for one sequence on a 16 MiB pool."""
    d = ctx.daemon
    w = worker(ctx, geometry(layers=8), "big-sketch")
    before = len(d.stats().sequences)
    for i in range(4):
        try:
            r = create(d, w, window=8, n_sink=0, victims="sketch", sketch_rows=32,
                       sketch_buckets=65536)
        except grpc.RpcError as e:
            assert e.code() == C.RESOURCE_EXHAUSTED, f"create {i}: {e.code().name}: {e.details()}"
            det = e.details()
            assert "--max-daemon-mb" in det and "GiB" in det, f"details: {det!r}"
            continue
        # Accepted (the bug): show what it costs, a bounded number of steps.
        seq = r.seq_id
        for _ in range(3):
            append(d, w, seq, 16)
            rss = vm_rss(d.proc.pid)
            assert rss - ctx.rss0 < RSS_GROWTH_BOUND, \
                f"CreateSequence {i} with sketch_rows=32 sketch_buckets=65536 was accepted and " \
                f"kvstashd grew from {ctx.rss0 / MIB:.0f} to {rss / MIB:.0f} MiB " \
                f"(Stats sketch bytes: {d.stats().tiers[2].bytes})"
        raise AssertionError(f"CreateSequence {i} with the largest sketch was accepted")
    assert len(d.stats().sequences) == before, "a refused create left a sequence behind"
    lim = d.stats().limits
    assert lim.daemon_memory_bytes == 1024 * MIB, f"default budget: {lim}"


def check_rss_bounded_while_sketching(ctx):
    """An accepted sketch sequence reserves its worst case, allocates no more
    than that, and the daemon stays small while a worker appends and steps."""
    d = ctx.daemon
    w = worker(ctx, geometry(layers=8), "sketcher")
    seq = call(d.store.CreateSequence,
               pb.CreateSequenceRequest(policy="streaming",
                                        params=params(window=8, n_sink=0, victims="sketch",
                                                      sketch_rows=8, sketch_buckets=1024)),
               w.md, "create a sketch sequence").seq_id
    q = seq_stats(d, seq)
    # 8 layers x 8 x 1024 cells x (2 x 16 floats + a count)
    assert q.sketch_reserved_bytes == 8 * 8 * 1024 * (2 * 16 * 4 + 4), q
    epoch = 0
    for _ in range(60):
        epoch = append(d, w, seq, 16, epoch).epoch
    lim = d.stats().limits
    assert 0 < lim.sketch_allocated_bytes <= lim.sketch_reserved_bytes, lim
    assert lim.sketch_reserved_bytes >= q.sketch_reserved_bytes, lim
    rss = vm_rss(d.proc.pid)
    print(f"     VmRSS {ctx.rss0 / MIB:.1f} -> {rss / MIB:.1f} MiB after 60 appends; sketch "
          f"reserved {lim.sketch_reserved_bytes}, allocated {lim.sketch_allocated_bytes} bytes")
    assert rss - ctx.rss0 < RSS_GROWTH_BOUND, \
        f"kvstashd grew from {ctx.rss0 / MIB:.0f} to {rss / MIB:.0f} MiB"
    call(d.store.ReleaseSequence, pb.ReleaseSequenceRequest(seq_id=seq), w.md, "release")
    after = d.stats().limits
    assert after.sketch_reserved_bytes == lim.sketch_reserved_bytes - q.sketch_reserved_bytes, \
        f"release gave back {lim.sketch_reserved_bytes - after.sketch_reserved_bytes} of " \
        f"{q.sketch_reserved_bytes} reserved bytes"


def check_huge_append_refused_before_commit(ctx):
    """Problem 4's reply: 65,536 tokens x 384 lists of positions is a 75 MB
    reply, over --max-reply-mb (64). Before: the daemon appended, then the
    client refused the reply (RESOURCE_EXHAUSTED from the client's side)
    with the tokens in. 1-dim fp16 K/V in 256-token blocks: 96 MiB of pool."""
    d = ctx.daemon
    g = geometry(layers=384, q_heads=1, kv_heads=1, head_dim=1, dtype=pb.DTYPE_FP16,
                 block_tokens=256)
    w = worker(ctx, g, "huge-append")
    seq = call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), w.md,
               "create").seq_id
    try:
        d.store.Append(pb.AppendRequest(seq_id=seq, count=65536), timeout=30, metadata=w.md)
        raise AssertionError("Append of 65536 tokens x 384 layers succeeded")
    except grpc.RpcError as e:
        det = e.details()
        assert e.code() == C.RESOURCE_EXHAUSTED, f"{e.code().name}: {det}"
    q = seq_stats(d, seq)
    assert q.appended == 0 and q.tokens == 0 and q.blocks == 0, \
        f"the refused Append was committed: appended={q.appended} tokens={q.tokens} " \
        f"blocks={q.blocks} (details: {det!r})"
    assert "--max-reply-mb" in det and "at most" in det, f"details: {det!r}"
    most = int(det.split("at most ")[1].split()[0])
    assert 10000 < most < 65536, f"suggested split {most}: {det!r}"
    print(f"     refused: {det}")
    # The split it suggests fits, reply and all, for a client that takes
    # --max-reply-mb (gRPC's default 4 MiB receive limit would not).
    with grpc.insecure_channel("unix:" + d.sock,
                               options=[("grpc.max_receive_message_length", -1)]) as ch:
        r = pb_grpc.StoreStub(ch).Append(pb.AppendRequest(seq_id=seq, count=most), timeout=60,
                                         metadata=w.md)
    assert r.ByteSize() <= 64 * MIB, r.ByteSize()
    assert len(r.writes) == 384 and all(len(lt.positions) == most for lt in r.writes)
    assert seq_stats(d, seq).appended == most


def check_session_quotas(ctx):
    """Per-session quotas on a daemon of their own: a session cannot pass
    --session-max-seqs or --session-max-blocks; another is unaffected."""
    d = Daemon(extra_args=["--session-max-seqs", "2", "--session-max-blocks", "10",
                           "--metrics", "127.0.0.1:0"])
    d.start()
    try:
        lim = d.stats().limits
        assert (lim.session_max_seqs, lim.session_max_blocks) == (2, 10), lim
        a, b = worker(ctx, daemon=d, name="a"), worker(ctx, daemon=d, name="b")
        # wire geometry: 2 layers, 16-token blocks: 16 tokens take 2 blocks
        sa = [call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), a.md,
                   f"a create {i}").seq_id for i in range(2)]
        e = expect_status(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"),
                          C.RESOURCE_EXHAUSTED, a.md, "a's third sequence")
        assert "--session-max-seqs" in e, e
        append(d, a, sa[0], 64)  # 8 blocks
        append(d, a, sa[1], 8)   # 2 blocks: a holds 10
        e = expect_status(d.store.Append, pb.AppendRequest(seq_id=sa[1], count=9),
                          C.RESOURCE_EXHAUSTED, a.md, "a's append past 10 blocks")
        assert "--session-max-blocks" in e and "holds 10" in e, e
        assert seq_stats(d, sa[1]).appended == 8, "the refused append was committed"
        append(d, a, sa[1], 8)  # the tail blocks' free slots need no block
        sess = {s.worker_name: s for s in d.stats().sessions}
        assert (sess["a"].blocks, sess["a"].sequences) == (10, 2), sess["a"]
        # b is unaffected by a being at its quota, and has its own
        sb = [call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), b.md,
                   f"b create {i}").seq_id for i in range(2)]
        append(d, b, sb[0], 80)
        expect_status(d.store.Append, pb.AppendRequest(seq_id=sb[1], count=1),
                      C.RESOURCE_EXHAUSTED, b.md, "b's append past 10 blocks")
        # releasing gives the quota back
        call(d.store.ReleaseSequence, pb.ReleaseSequenceRequest(seq_id=sa[0]), a.md, "release")
        append(d, a, sa[1], 64)
        call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), a.md,
             "a creates again")
        # what an operator sees: `kvstash status` and /metrics
        out = subprocess.run([os.environ["KVSTASH_CLI"], "status", "--socket", d.sock],
                             capture_output=True, text=True, timeout=10).stdout
        ida, idb = a.attached.session_id, b.attached.session_id
        assert f"worker {ida} (a): 2 of 2 sequences, 10 of 10 blocks" in out, out
        assert f"worker {idb} (b): 2 of 2 sequences, 10 of 10 blocks" in out, out
        assert "limits: daemon memory 1.0 GiB (--max-daemon-mb)" in out, out
        text = metrics_text(d)
        for line in (f'kvstash_worker_blocks{{session="{ida}"}} 10',
                     'kvstash_session_quota{kind="blocks"} 10',
                     "kvstash_daemon_memory_limit_bytes 1073741824"):
            assert line in text.splitlines(), f"/metrics lacks {line!r}"
        for w in (a, b):
            w.close()
    finally:
        d.stop()
        d.cleanup()


def check_quota_flags_validated(ctx):
    del ctx
    for args in (["--session-max-blocks", "-1"], ["--max-reply-mb", "0"],
                 ["--max-daemon-mb", "99999999999"]):
        d = Daemon(extra_args=args)
        try:
            d.start(timeout=5)
        except AssertionError as e:
            assert "exited" in str(e), f"{args}: {e}"
        else:
            d.kill()
            raise AssertionError(f"kvstashd accepted {args}")
        finally:
            d.cleanup()


if __name__ == "__main__":
    sys.exit(run_tests("test_hostile_limits", [
        check_setup,
        check_largest_sketch_refused_at_create,
        check_rss_bounded_while_sketching,
        check_huge_append_refused_before_commit,
        check_session_quotas,
        check_quota_flags_validated,
    ], daemon_kwargs={"pool_mb": 128}, time_limit=120))
