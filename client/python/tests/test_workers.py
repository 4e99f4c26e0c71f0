"""Python and C workers in one pool (issue 13, acceptance 3): two Python
workers (py_worker.py) and one C worker (kvs_test_worker) share a pool,
each verifying every token it holds after every append; a SIGKILL of one
Python worker is reclaimed as tests/integration/test_kill.py checks a C
worker's: within 2 s Stats shows its session, sequences and blocks gone,
and the others finish intact."""
import signal
import time

import kvstash
from procs import PyWorkerProc, wait_until
from worker_procs import WorkerProc

RECLAIM_LIMIT_S = 2.0


def blocks_accounted(st):
    """Blocks the pools lend out equal the blocks the sequences hold."""
    lent = sum(p["blocks_total"] - p["blocks_free"] for p in st["pools"])
    held = sum(q["blocks"] for q in st["sequences"])
    return lent == held, f"pools lend {lent} blocks, sequences hold {held}"


def test_python_and_c_workers_share_a_pool_and_a_killed_one_is_reclaimed(fresh_daemon):
    d = fresh_daemon
    c_worker = WorkerProc(d, "c-survivor", seed=10, tokens=300, step=1, sleep_ms=5)
    py_survivor = PyWorkerProc(d, "py-survivor", seed=11, tokens=200, step=2, sleep_ms=5,
                               policy="streaming", params=("n_sink=2", "window=40"))
    victim = PyWorkerProc(d, "py-victim", seed=99, tokens=100000, step=4, sleep_ms=1,
                          sequences=3)
    workers = [c_worker, py_survivor, victim]
    try:
        for w in workers:
            w.wait_line("ATTACHED")
        pools = {int(line.split("pool=")[1]) for w in workers for line in w.lines
                 if line.startswith("ATTACHED")}
        assert len(pools) == 1, f"the workers attached to pools {pools}, expected one"
        victim_session = victim.session_id()
        victim.wait_line("APPENDED 120")  # well into writing
        st = kvstash.stats(d.sock)
        (pool,) = st["pools"]
        assert pool["sessions"] == 3, pool
        names = {x["worker_name"] for x in st["sessions"]}
        assert names == {"c-survivor", "py-survivor", "py-victim"}, names
        victim_seqs = [q for q in st["sequences"] if q["session_id"] == victim_session]
        assert len(victim_seqs) == 3 and all(q["blocks"] > 0 for q in victim_seqs), victim_seqs

        victim.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        victim.proc.wait()

        def reclaimed():
            st = kvstash.stats(d.sock)
            gone = (all(x["session_id"] != victim_session for x in st["sessions"]) and
                    all(q["session_id"] != victim_session for q in st["sequences"]))
            return gone and blocks_accounted(st)[0]

        assert wait_until(reclaimed, timeout=RECLAIM_LIMIT_S), \
            f"victim not reclaimed {RECLAIM_LIMIT_S} s after SIGKILL: " \
            f"{blocks_accounted(kvstash.stats(d.sock))[1]}"
        print(f"reclaimed {(time.monotonic() - t0) * 1000:.0f} ms after SIGKILL")
        alive = [w.name for w in (c_worker, py_survivor) if w.proc.poll() is None]
        assert alive, "the survivors finished before the kill: the test proves nothing"
        assert c_worker.finish()["tokens"] == 300
        r = py_survivor.finish()
        assert r["tokens"] == 200 and r["checked"] > 0, r
        assert "reason=fd-closed" in d.log() or "reason=lease-ended" in d.log(), d.log_tail()
        st = kvstash.stats(d.sock)
        assert not st["sessions"] and not st["sequences"], st
        assert blocks_accounted(st)[0]
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
