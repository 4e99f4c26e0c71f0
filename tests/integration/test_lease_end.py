"""test_lease_end.py - issue 14, lease end: a session that ended without a
detach leaves its blocks quarantined until its worker's process has exited.

A closed fd socket does not prove that the worker stopped writing through
its mapping of the pool (on a GPU: that its kernels stopped), so with
kvstashd --lease-end quarantine the blocks of such a session stay out of
use until a pidfd of the worker's process (opened at HELLO) turns readable.

  1. A worker process maps the pool (MAP), appends tokens (holds N blocks)
     and closes its fd socket without a detach while it keeps running:
     Stats shows N quarantined blocks (pool and totals) in one quarantined
     session, the feed says worker.quarantined, and a second worker that
     fills the pool gets exactly the other blocks: one token more is
     RESOURCE_EXHAUSTED rather than a quarantined block. When the first
     process exits, the blocks are free within a bounded time, the feed says
     worker.released (reason process-exited), and the second worker can
     take them.
  2. A clean Detach frees at once, with quarantine on.
  3. With --lease-end free (the host default) the same close frees at once.
  4. A SIGSTOPped worker's session ended by the lease timeout (issue 12)
     is quarantined the same way until a SIGKILL ends its process; its
     pool goes only then.
  5. Stats, `kvstash status` and `kvstash stats` say the device and IPC kind,
     the lease-end mode and the quarantine (test_metrics checks /metrics).
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from kvstash_harness import (Daemon, Worker, call, expect_status, fd_request, geometry, pb,
                             run_tests, wait_until)

CLI = os.environ.get("KVSTASH_CLI", "")
GEOM = dict(layers=2, q_heads=4, kv_heads=2, head_dim=8, block_tokens=16)  # 2 KiB blocks
TOKENS = 100  # 7 blocks a layer: 14 blocks
HELD = 2 * -(-TOKENS // GEOM["block_tokens"])
RELEASE_WITHIN_S = 3.0  # the fd-socket thread polls pidfds every 100 ms

# The worker process: attach, map the pool, hold TOKENS tokens, then close
# its fd socket without a detach when told ("close") and exit when told
# (stdin closed). Its mapping of the pool stays until it exits.
VICTIM = r"""
import mmap, os, sys
import grpc
from kvstash_harness import call, fd_hello, fd_request, geometry, pb, pb_grpc
sock, tokens = sys.argv[1], int(sys.argv[2])
s, token = fd_hello(sock)
md = (("kvstash-token", token),)
channel = grpc.insecure_channel("unix:" + sock)
store = pb_grpc.StoreStub(channel)
geom = geometry(**eval(sys.argv[3]))
r = call(store.Attach, pb.AttachRequest(model="lease-end", geometry=geom, worker_name="victim"),
         md)
text, fds = fd_request(s, "MAP %d" % r.pool_id)
assert text.startswith("OK") and len(fds) == 1, text
pool = mmap.mmap(fds[0], r.pool_bytes)
os.close(fds[0])
q = call(store.CreateSequence, pb.CreateSequenceRequest(policy="full"), md)
call(store.Append, pb.AppendRequest(seq_id=q.seq_id, count=tokens), md)
print("READY %d %d" % (r.session_id, r.pool_id), flush=True)
assert sys.stdin.readline().strip() == "close"
s.close()  # no Detach: the session ends, the mapping stays
print("CLOSED", flush=True)
sys.stdin.read()  # until stdin closes
pool[0:4] = b"late"  # a worker may still write after its session ended
"""


class Victim:
    """The worker process of VICTIM."""

    def __init__(self, d):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", VICTIM, d.sock, str(TOKENS), repr(GEOM)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), f"victim: {line!r} {self._err()}"
        self.session_id, self.pool_id = map(int, line.split()[1:])

    def _err(self):
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def close_session(self):
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("CLOSED"), f"victim: {line!r} {self._err()}"

    def exit(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0, f"victim exited {self.proc.returncode}: " \
                                                f"{self.proc.stderr.read()}"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Feed:
    """`kvstash watch --json`, subscribed (a probe worker's reclaim seen)."""

    def __init__(self, d):
        self.proc = subprocess.Popen([CLI, "--socket", d.sock, "watch", "--json",
                                      "--timeout", "120"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        for _ in range(40):  # nanomsg subscribes in the background
            p = Worker(d)
            p.attach(model="probe", name="probe", lease=False)
            p.close()
            if self.wait("worker.reclaimed", lambda e: True, 0.5, must=False):
                return
        raise AssertionError("kvstash watch saw no probe worker")

    def events(self, topic):
        return [e for e in (json.loads(x) for x in list(self.lines)) if e["topic"] == topic]

    def wait(self, topic, pred, timeout, must=True):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(topic) if pred(e)]
            if found:
                return found
            time.sleep(0.05)
        if must:
            raise AssertionError(f"no {topic} event within {timeout} s: {self.lines[-5:]}")
        return None

    def close(self):
        self.proc.kill()
        self.proc.wait()


def pool_of(st, pool_id):
    (p,) = [p for p in st.pools if p.pool_id == pool_id]
    return p


def fill(d, w, seq_id, blocks):
    """Append the tokens that take exactly `blocks` blocks (a multiple of the
    layers) to w's sequence seq_id, in a few calls."""
    left = blocks // GEOM["layers"] * GEOM["block_tokens"]
    while left > 0:
        n = min(left, 4096)
        call(d.store.Append, pb.AppendRequest(seq_id=seq_id, count=n), w.md, "Append (fill)")
        left -= n


def check_quarantine_until_the_process_exits(ctx):
    d = ctx.daemon
    feed, victim, filler = Feed(d), None, None
    try:
        victim = Victim(d)
        st = d.stats()
        assert st.lease_end == "quarantine", st.lease_end
        total = pool_of(st, victim.pool_id).blocks_total
        assert pool_of(st, victim.pool_id).blocks_free == total - HELD, pool_of(st, victim.pool_id)
        victim.close_session()
        # Its session ends (no longer listed, its sequence gone)...
        st = wait_until(lambda: (lambda s: s if all(x.session_id != victim.session_id
                                                    for x in s.sessions) else None)(d.stats()),
                        5.0, "the closed session ends")
        assert not st.sequences, st.sequences
        # ...but its blocks stay out of use while its process lives.
        p = pool_of(st, victim.pool_id)
        assert (p.blocks_quarantined, p.blocks_free, p.blocks_used) == (HELD, total - HELD, 0), p
        assert (st.quarantined_sessions, st.quarantined_blocks) == (1, HELD), st
        (ev,) = feed.wait("worker.quarantined", lambda e: e["session"] == victim.session_id, 5.0)
        assert (ev["pid"], ev["blocks"], ev["pool"], ev["reason"]) == \
            (victim.proc.pid, HELD, victim.pool_id, "fd-closed"), ev
        # A second worker filling the pool gets every other block, none of those.
        filler = Worker(d)
        filler.attach(model="lease-end", geom=geometry(**GEOM), name="filler", lease=False)
        seq = call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), filler.md)
        fill(d, filler, seq.seq_id, total - HELD)
        detail = expect_status(d.store.Append, pb.AppendRequest(seq_id=seq.seq_id, count=1),
                               grpc.StatusCode.RESOURCE_EXHAUSTED, filler.md, "Append (full)")
        st = d.stats()
        p = pool_of(st, victim.pool_id)
        assert (p.blocks_free, p.blocks_quarantined) == (0, HELD), p
        (fs,) = [s for s in st.sessions if s.worker_name == "filler"]
        assert fs.blocks == total - HELD, (fs.blocks, total, detail)
        # The process exits: the blocks come back within a bound.
        time.sleep(0.3)  # a few reaper ticks: nothing is released while it lives
        assert d.stats().quarantined_blocks == HELD, "released while the worker still ran"
        t0 = time.monotonic()
        victim.exit()
        st = wait_until(lambda: (lambda s: s if s.quarantined_sessions == 0 else None)(d.stats()),
                        RELEASE_WITHIN_S, "the quarantine released after the worker exited")
        took = time.monotonic() - t0
        p = pool_of(st, victim.pool_id)
        assert (p.blocks_free, p.blocks_quarantined, st.quarantined_blocks) == (HELD, 0, 0), p
        (ev,) = feed.wait("worker.released", lambda e: e["session"] == victim.session_id, 5.0)
        assert (ev["pid"], ev["blocks"], ev["reason"]) == \
            (victim.proc.pid, HELD, "process-exited"), ev
        # Now they are the filler's to take.
        fill(d, filler, seq.seq_id, HELD)
        assert pool_of(d.stats(), victim.pool_id).blocks_free == 0
        assert re.search(rf"quarantine_released session={victim.session_id} .*blocks={HELD}",
                         d.log()), "no log line for the release"
        print(f"     released {took * 1e3:.0f} ms after the worker's exit", flush=True)
        filler.close()
    finally:
        if victim is not None:
            victim.kill()
        feed.close()


def check_detach_frees_at_once(ctx):
    d = ctx.daemon
    w = Worker(d)
    r = w.attach(model="lease-end", geom=geometry(**GEOM), name="detacher", lease=False)
    text, fds = fd_request(w.fd_sock, f"MAP {r.pool_id}")
    assert text.startswith("OK") and fds, text
    os.close(fds[0])
    seq = call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), w.md)
    call(d.store.Append, pb.AppendRequest(seq_id=seq.seq_id, count=TOKENS), w.md)
    assert pool_of(d.stats(), r.pool_id).blocks_free == r.block_count - HELD
    call(d.store.Detach, pb.DetachRequest(), w.md, "Detach")
    st = d.stats()
    assert st.quarantined_sessions == 0 and st.quarantined_blocks == 0, st
    # The pool is gone with its last session (nothing quarantined holds it),
    # or, if another holds it, every block is free.
    assert all(p.blocks_free == p.blocks_total for p in st.pools), st.pools
    w.close()


def check_lease_end_free_frees_at_once(ctx):
    d = Daemon(pool_mb=1, extra_args=("--lease-end", "free"))
    d.start()
    victim = None
    try:
        assert d.stats().lease_end == "free"
        victim = Victim(d)
        keeper = Worker(d)  # keeps the pool alive, to see its blocks
        keeper.attach(model="lease-end", geom=geometry(**GEOM), name="keeper", lease=False)
        victim.close_session()
        st = wait_until(lambda: (lambda s: s if all(x.session_id != victim.session_id
                                                    for x in s.sessions) else None)(d.stats()),
                        5.0, "the closed session ends")
        p = pool_of(st, victim.pool_id)
        assert (p.blocks_free, p.blocks_quarantined) == (p.blocks_total, 0), p
        assert (st.quarantined_sessions, st.quarantined_blocks) == (0, 0), st
        assert "session_quarantined" not in d.log()
        keeper.close()
        victim.exit()
        d.stop()
    finally:
        if victim is not None:
            victim.kill()
        d.kill()
    d.cleanup()


def check_stopped_worker_holds_its_blocks_until_it_exits(ctx):
    """The lease timeout (issue 12) ends a SIGSTOPped worker's session; with
    quarantine its blocks wait for the process, which a SIGKILL ends."""
    d = Daemon(pool_mb=1, extra_args=("--lease-end", "quarantine", "--lease-timeout-ms", "500"))
    d.start()
    victim = None
    try:
        victim = Victim(d)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        st = wait_until(lambda: (lambda s: s if s.quarantined_sessions == 1 else None)(d.stats()),
                        5.0, "the stopped worker's session quarantined at the lease timeout")
        assert all(x.session_id != victim.session_id for x in st.sessions), st.sessions
        assert (st.quarantined_blocks, pool_of(st, victim.pool_id).blocks_quarantined) == \
            (HELD, HELD), st
        assert re.search(rf"session_quarantined session={victim.session_id} .*"
                         rf"reason=lease-timeout blocks={HELD}", d.log()), "no quarantine log"
        time.sleep(0.3)
        assert d.stats().quarantined_blocks == HELD, "released while the worker was stopped"
        victim.kill()  # SIGKILL ends a stopped process too
        st = wait_until(lambda: (lambda s: s if s.quarantined_sessions == 0 else None)(d.stats()),
                        RELEASE_WITHIN_S, "the quarantine released after SIGKILL")
        assert st.quarantined_blocks == 0 and not st.pools, st  # the pool went with it
        d.stop()
    finally:
        if victim is not None:
            victim.kill()
        d.kill()
    d.cleanup()


def check_status_and_stats_say_device_ipc_and_lease_end(ctx):
    d = ctx.daemon
    w = Worker(d)  # a pool, for its blocks line
    w.attach(model="lease-end", geom=geometry(**GEOM), name="status", lease=False)
    st = d.stats()
    assert (st.backend, st.device, st.device_name, st.ipc) == (d.backend, "none", "", "memfd"), st
    out = subprocess.run([CLI, "--socket", d.sock, "status"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert "device: none, ipc memfd" in out.stdout, out.stdout
    assert re.search(r"lease end: quarantine; quarantined: 0 session\(s\), 0 block\(s\)",
                     out.stdout), out.stdout
    assert re.search(r"\d+ retired, 0 quarantined;", out.stdout), out.stdout
    js = json.loads(subprocess.run([CLI, "--socket", d.sock, "stats"], capture_output=True,
                                   text=True, timeout=30).stdout)
    assert (js["device"], js["ipc"], js["lease_end"]) == ("none", "memfd", "quarantine"), js
    assert js["pools"][0]["blocks_quarantined"] == 0 and js["quarantined_blocks"] == 0, js
    w.close()


if __name__ == "__main__":
    sys.exit(run_tests("test_lease_end", [
        check_status_and_stats_say_device_ipc_and_lease_end,
        check_quarantine_until_the_process_exits,
        check_detach_frees_at_once,
        check_lease_end_free_frees_at_once,
        check_stopped_worker_holds_its_blocks_until_it_exits,
    ], daemon_kwargs={"pool_mb": 1, "extra_args": ("--lease-end", "quarantine")}))
