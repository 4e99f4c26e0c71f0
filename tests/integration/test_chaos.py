"""Chaos (issue 12): honest workers write and verify their K/V while a driver
starts churn workers and SIGKILLs, SIGSTOPs, resumes and restarts them at
random, and moves the churn workers' tokens between tiers with the CLI. At
the end every honest worker verifies all its K/V byte for byte, Stats
balances (blocks lent equal blocks held by sequences and by the lease-end
quarantine of killed workers, which runs on here as on the cuda backend,
then the whole pool free), and the daemon's fds and mappings did not grow.

KVSTASH_CHAOS_S sets the length (CI: 12 s); KVSTASH_CHAOS_SEED the driver's
seed (printed, so a failure can be replayed). docs/reliability.md records a
long run."""
import collections
import os
import random
import signal
import subprocess
import sys
import time

from kvstash_harness import run_tests
from worker_procs import WorkerProc

DURATION_S = float(os.environ.get("KVSTASH_CHAOS_S", "12"))
SEED = int(os.environ.get("KVSTASH_CHAOS_SEED", str(int(time.time()) % 100000)))
MAX_CHURN = 4
RECLAIM_LIMIT_S = 5.0
# Honest workers write for the whole run; the per-session quota keeps the
# churn workers (which write without end) from taking the pool from them.
HONEST_TOKENS = 600 if DURATION_S <= 30 else 4000
POOL_MB, SESSION_MAX_BLOCKS = 32, 2048


def daemon_fds_and_maps(d):
    """The daemon's open fds (what each is) and its mappings."""
    pid = d.proc.pid
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        return fds, f.read().splitlines()


def cli(d, *args):
    binary = os.environ.get("KVSTASH_CLI")
    assert binary and os.access(binary, os.X_OK), f"KVSTASH_CLI={binary!r} (run through ctest)"
    return subprocess.run([binary, *args, "--socket", d.sock], capture_output=True, text=True,
                          timeout=30)


class Churn:
    """A worker that writes without end until the driver stops it."""

    def __init__(self, d, rng, n):
        policy = rng.choice(("full", "streaming"))
        params = ("n_sink=2", f"window={rng.randint(8, 40)}") if policy == "streaming" else ()
        self.w = WorkerProc(d, f"churn{n}", seed=1000 + n, tokens=10 ** 6,
                            step=rng.randint(1, 8), sleep_ms=rng.randint(1, 6), policy=policy,
                            params=params, sequences=rng.randint(1, 2))
        self.stopped = False
        self.session = None

    def alive(self):
        return self.w.proc.poll() is None

    def signal(self, sig):
        if self.alive():
            self.w.proc.send_signal(sig)


def check_chaos(ctx):
    d = ctx.daemon
    rng = random.Random(SEED)
    print(f"chaos: {DURATION_S:.0f} s, seed {SEED}", flush=True)
    # The baseline: a pool exists and a worker has come and gone.
    WorkerProc(d, "warmup", seed=1, tokens=40).finish()
    fds0, maps0 = daemon_fds_and_maps(d)

    honest = [WorkerProc(d, f"honest{i}", seed=10 + i, tokens=HONEST_TOKENS, step=1 + i,
                         sleep_ms=max(12, int(DURATION_S * 1000 * (1 + i) / HONEST_TOKENS)),
                         policy=("full", "streaming")[i % 2],
                         params=(() if i % 2 == 0 else ("n_sink=4", "window=32")), hold=True)
              for i in range(3)]
    # Their sessions: the operator's moves are for the churn workers only
    # (an honest worker checks tier moves only when told of each).
    for w in honest:
        w.wait_line("ATTACHED")
    mine = {w.session_id() for w in honest}
    churn, started, actions = [], 0, {}
    deadline = time.monotonic() + DURATION_S
    while time.monotonic() < deadline:
        churn = [c for c in churn if c.alive()]
        act = rng.choice(("start", "start", "kill", "stop", "cont", "move"))
        if act == "start" and len(churn) < MAX_CHURN or not churn:
            churn.append(Churn(d, rng, started))
            started += 1
            act = "start"
        elif act == "kill":
            rng.choice(churn).signal(signal.SIGKILL)
        elif act == "stop":
            c = rng.choice(churn)
            c.signal(signal.SIGSTOP)
            c.stopped = True
        elif act == "cont":
            for c in churn:
                if c.stopped:
                    c.signal(signal.SIGCONT)
                    c.stopped = False
                    break
        elif act == "move":
            # Another session's tokens, moved by the operator while it writes.
            seqs = [q for q in d.stats().sequences
                    if q.session_id not in mine and q.appended > 2]
            if seqs:
                q = rng.choice(seqs)
                op = rng.choice(("demote", "offload", "revive"))
                first = rng.randrange(q.appended - 1)
                last = min(q.appended - 1, first + rng.randint(1, 48))
                r = cli(d, op, str(q.seq_id), f"{first}-{last}")
                # The sequence may be gone (its worker killed: 4, NOT_FOUND) or the
                # move refused (1: the pool full, the budget spent); never a crash.
                assert r.returncode in (0, 1, 4), f"kvstash {op}: exit {r.returncode}: {r.stderr}"
                assert "internal" not in r.stderr.lower(), f"kvstash {op}: {r.stderr}"
        actions[act] = actions.get(act, 0) + 1
        time.sleep(rng.uniform(0.05, 0.4))
    print(f"chaos: {started} churn workers, actions {actions}", flush=True)

    for c in churn:
        c.signal(signal.SIGKILL)
        c.w.proc.wait()
    for w in honest:
        w.wait_line("READY", timeout=120)
        r = w.finish()
        assert r["tokens"] == HONEST_TOKENS, f"{w.name}: {r}"
        assert r["checked"] > 0, f"{w.name}: {r}"

    # Every session reclaimed, every block back.
    t0 = time.monotonic()
    while True:
        st = d.stats()
        lent = sum(p.blocks_total - p.blocks_free for p in st.pools)
        # Killed workers' blocks are quarantined until their process is gone.
        held = sum(q.blocks for q in st.sequences) + st.quarantined_blocks
        assert st.quarantined_blocks == sum(p.blocks_quarantined for p in st.pools), st
        if not st.sessions and not st.sequences and lent == 0:
            break
        assert lent == held or time.monotonic() - t0 < RECLAIM_LIMIT_S, \
            f"pools lend {lent} blocks, sequences and quarantine hold {held}"
        assert time.monotonic() - t0 < RECLAIM_LIMIT_S, \
            f"not reclaimed after {RECLAIM_LIMIT_S} s: {len(st.sessions)} sessions, " \
            f"{len(st.sequences)} sequences, {lent} blocks lent"
        time.sleep(0.05)
    log = d.log()
    quarantined, released = log.count("msg=session_quarantined"), log.count("quarantine_released")
    print(f"chaos: {quarantined} killed workers' sessions quarantined, {released} released",
          flush=True)
    assert quarantined == released, "a quarantine outlived its worker's process"
    # Ended sessions' rings are reaped once their threads stop.
    while True:
        fds, maps = daemon_fds_and_maps(d)
        if len(fds) <= len(fds0) or time.monotonic() - t0 > RECLAIM_LIMIT_S:
            break
        time.sleep(0.05)
    print(f"chaos: daemon fds {len(fds0)} -> {len(fds)}, mappings {len(maps0)} -> {len(maps)}",
          flush=True)
    kinds = lambda fds: collections.Counter(t.split("[")[0] for t in fds.values())  # noqa: E731
    new = dict(kinds(fds) - kinds(fds0))
    assert len(fds) <= len(fds0), f"the daemon's fds grew from {len(fds0)} to {len(fds)}: {new}"
    # Mappings of files and memfds (pools, rings) must all be gone. Anonymous
    # ones are the allocator's (glibc keeps a malloc arena per thread that
    # ever ran and caches thread stacks; ASan and TSan map their own): they
    # are printed, not judged.
    named = lambda maps: [m.split()[5] for m in maps if len(m.split()) > 5]  # noqa: E731
    extra = sorted(set(named(maps)) - set(named(maps0)))
    assert len(named(maps)) <= len(named(maps0)), \
        f"the daemon maps files it did not before: {extra}"
    anon = len(maps) - len(named(maps)) - (len(maps0) - len(named(maps0)))
    print(f"chaos: anonymous mappings {anon:+d} lines", flush=True)


if __name__ == "__main__":
    # --dumpable: the test reads the daemon's /proc/<pid>/fd and maps, which a
    # non-dumpable daemon (the default) hides from a test run as another user.
    sys.exit(run_tests("chaos", [check_chaos],
                       daemon_kwargs={"pool_mb": POOL_MB,
                                      "extra_args": ("--dumpable", "--session-max-blocks",
                                                     str(SESSION_MAX_BLOCKS),
                                                     # what the cuda backend does by default
                                                     "--lease-end", "quarantine")},
                       time_limit=max(240, int(DURATION_S) + 180)))
