"""Several real worker processes write K/V into their own sequences of one
kvstashd at the same time; every value each reads back (through its block
tables and token positions) equals what it wrote. Acceptance 2 of issue 2."""
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


def check_everything_released_after(ctx):
    st = ctx.daemon.stats()
    assert len(st.sessions) == 0, f"sessions left: {st.sessions}"
    assert len(st.sequences) == 0, f"sequences left: {st.sequences}"
    for p in st.pools:
        assert p.blocks_free == p.blocks_total, f"pool {p.model} leaks blocks: {p}"


if __name__ == "__main__":
    sys.exit(run_tests("concurrent_workers", [check_concurrent_full_workers,
                                              check_concurrent_mixed_policies,
                                              check_everything_released_after]))
