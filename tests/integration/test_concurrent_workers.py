"""Several real worker processes write K/V into their own sequences of one
kvstashd at the same time; every value each reads back (through its block
tables and token positions) equals what it wrote. Acceptance 2 of issue 2;
and the same while another worker demotes and revives in a loop, its
Revives copying outside the store's lock (issue 16 §3, acceptance 3)."""
import json
import os
import subprocess
import sys

from kvstash_harness import run_tests
from worker_procs import WorkerProc

N_WORKERS = 4


def check_concurrent_full_workers(ctx):
    workers = [WorkerProc(ctx.daemon, f"w{i}", seed=100 + i, tokens=300, step=1 + i % 3,
                          sequences=2) for i in range(N_WORKERS)]
    results = [w.finish() for w in workers]
    for w, r in zip(workers, results):
        assert r["tokens"] == 300, f"{w.name}: {r}"
        # 2 sequences x 3 layers x 300 tokens, verified at least once.
        assert r["checked"] >= 2 * 3 * 300, f"{w.name}: checked only {r['checked']}"
    ids = [sid for r in results for sid in r["seq_ids"]]
    assert len(set(ids)) == 2 * N_WORKERS, f"sequence ids are not distinct: {ids}"


def check_concurrent_mixed_policies(ctx):
    workers = [
        WorkerProc(ctx.daemon, "full", seed=1, tokens=250, step=2),
        WorkerProc(ctx.daemon, "stream-a", seed=2, tokens=250, policy="streaming",
                   params=("n_sink=4", "window=20")),
        WorkerProc(ctx.daemon, "stream-b", seed=3, tokens=250, step=5, policy="streaming",
                   params=("n_sink=0", "window=9")),
    ]
    for w in workers:
        w.finish()


def check_steppers_verify_while_another_revives(ctx):
    """kvs_tier_worker keeps a sequence whose tokens but the newest 8 are
    INT8 and whose window's victims go to the sketch; once it says
    REVIVING, three workers of another model step their own sequences and
    read back every value they wrote, while it appends a token (a step
    that demotes one) and revives and checks both layers, round after
    round, until they are done."""
    mover = subprocess.Popen(
        [os.environ["KVSTASH_TIER_WORKER"], "--socket", ctx.daemon.sock, "--tokens", "200",
         "--window", "64", "--demote", "int8", "--victims", "sketch", "--rounds", "100000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = mover.stdout.readline()
        assert line.strip() == "REVIVING", f"kvs_tier_worker: {line!r} {mover.poll()}"
        workers = [
            WorkerProc(ctx.daemon, "full", seed=11, tokens=300, step=1),
            WorkerProc(ctx.daemon, "stream", seed=12, tokens=300, step=2, policy="streaming",
                       params=("n_sink=4", "window=40")),
            WorkerProc(ctx.daemon, "full-2", seed=13, tokens=300, step=3, sequences=2),
        ]
        results = [w.finish(timeout=240) for w in workers]
        still = mover.poll() is None
        out, err = mover.communicate(timeout=120)  # closes stdin: the last round
    finally:
        if mover.poll() is None:
            mover.kill()
    assert still, "kvs_tier_worker ended before the workers did: nothing overlapped"
    assert mover.returncode == 0, f"kvs_tier_worker: exit {mover.returncode}\n{out[-2000:]}{err}"
    last = json.loads(out.strip().splitlines()[-1])
    assert last["ok"] and last["int8"] > 0 and last["sketch"] > 0, last
    for w, r in zip(workers, results):
        assert r["tokens"] == 300 and r["checked"] >= 3 * 300, f"{w.name}: {r}"


def check_everything_released_after(ctx):
    st = ctx.daemon.stats()
    assert len(st.sessions) == 0, f"sessions left: {st.sessions}"
    assert len(st.sequences) == 0, f"sequences left: {st.sequences}"
    for p in st.pools:
        assert p.blocks_free == p.blocks_total, f"pool {p.model} leaks blocks: {p}"


if __name__ == "__main__":
    sys.exit(run_tests("concurrent_workers", [check_concurrent_full_workers,
                                              check_concurrent_mixed_policies,
                                              check_steppers_verify_while_another_revives,
                                              check_everything_released_after]))
