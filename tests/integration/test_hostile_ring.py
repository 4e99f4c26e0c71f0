"""Hostile ring test (issue 12, problem 1 and the ring half of problem 5).

1. Workers map their sessions' rings and rewrite `closing` to 0 (and garbage
   into the rest of the header) in a tight loop while their sessions end. The
   daemon must not care: an honest worker still gets HELLO, Attach, its own
   ring, an append and a step within ADMIT_LIMIT_S, health says SERVING and
   is right, and SIGTERM stops kvstashd with status 0 within STOP_LIMIT_S.
2. A worker waiting in a ring call when kvstashd is SIGKILLed gets
   KVS_ERR_UNAVAILABLE within DEATH_LIMIT_S of kvstashd being reaped (its
   sockets closed), not after the 10 s deadline.
3. Workers rewrite their decode steps' statistics in the ring while the
   daemon reads them (h2o, tova and ov_block take them in place, issue 16
   §2): every step is answered OK or INVALID_ARGUMENT, their sequences hold
   no more than their policies keep, and an honest worker is served after.

The worker sides are tests/integration/kvs_hostile_ring.c ($KVSTASH_HOSTILE_RING).
"""
import os
import select
import signal
import subprocess
import sys
import time

from kvstash_harness import SERVING, Daemon, Worker, fd_hello, fd_request, run_tests

# Sanitizer builds run every process several times slower.
ADMIT_LIMIT_S = 4.0 if os.environ.get("KVSTASH_SANITIZE") == "1" else 2.0
STOP_LIMIT_S = 5.0
DEATH_LIMIT_S = 1.0
KVS_ERR_UNAVAILABLE = -6
# Whether the unfixed daemon's ring thread sees `closing` before a scribbler
# resets it is a race; several sessions, two scribblers and three rounds make
# the hostile side win it in nearly every run (the check must fail there).
HOSTILE_SESSIONS = 8
SCRIBBLERS = 2
ROUNDS = 3
HOSTILE = os.environ.get("KVSTASH_HOSTILE_RING")


def read_line(proc, timeout, what):
    """The next line of proc's stdout, or an AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    line = b""
    fd = proc.stdout.fileno()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"{what}: no line within {timeout} s (so far {line!r})"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1)
            assert chunk, f"{what}: exited ({proc.wait()}) before a line (so far {line!r})"
            line += chunk
    return line.decode().strip()


def wait_stopped(pid, timeout=5.0):
    """Wait until /proc says the process is stopped (state T)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


def worker_env(rpc_timeout_ms):
    return dict(os.environ, KVSTASH_RPC_TIMEOUT_MS=str(rpc_timeout_ms))


class FreshDaemon:
    """A daemon of the check's own (each check ends it its own way)."""

    def __enter__(self):
        self.d = Daemon()
        self.d.start()
        return self.d

    def __exit__(self, *exc):
        self.d.kill()
        if exc[0] is None:
            self.d.cleanup()
        else:
            print(self.d.log_tail(40), flush=True)


def end_scribbled_sessions(d):
    """One round: HOSTILE_SESSIONS sessions take their rings, SCRIBBLERS
    processes scribble on all of them, the sessions end; then an honest
    worker must get through within ADMIT_LIMIT_S. Returns the scribblers,
    still running (the caller kills them)."""
    hostiles, rings, size = [], [], None
    for i in range(HOSTILE_SESSIONS):
        w = Worker(d)
        w.attach("wire", name=f"hostile{i}")
        text, fds = fd_request(w.fd_sock, "RING")
        assert text.startswith("OK ") and len(fds) == 1, f"RING answered {text!r}"
        hostiles.append(w)
        rings += fds
        size = text[3:]
    scribblers = [subprocess.Popen([HOSTILE, "scribble", size, *map(str, rings)],
                                   pass_fds=rings, stdout=subprocess.PIPE)
                  for _ in range(SCRIBBLERS)]
    for fd in rings:
        os.close(fd)
    try:
        for p in scribblers:
            assert read_line(p, 5.0, "scribbler") == "SCRIBBLING"
        time.sleep(0.2)  # the ring threads have stopped spinning: they sleep on the futex
        for w in hostiles:  # the sessions end while `closing` keeps being reset
            w.close()
        t0 = time.monotonic()
        honest = subprocess.run([HOSTILE, "honest", d.sock], env=worker_env(3 * 1000),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        took = time.monotonic() - t0
        assert honest.returncode == 0, (f"honest worker failed ({honest.returncode}) after "
                                        f"{took:.2f} s: {honest.stderr.decode().strip()}")
        assert took < ADMIT_LIMIT_S, f"honest worker took {took:.2f} s"
        print(f"     honest worker: {honest.stdout.decode().strip()} "
              f"({took * 1000:.0f} ms with its process)", flush=True)
        # Admission still answers, and health says so truthfully.
        s, _token = fd_hello(d.sock, timeout=ADMIT_LIMIT_S)
        s.close()
        assert d.health() == SERVING
        st = d.stats()
        assert not [x for x in st.sessions if x.worker_name.startswith("hostile")], st.sessions
        assert all(p.poll() is None for p in scribblers), \
            "a scribbler stopped: the test proves nothing"
    except BaseException:
        for p in scribblers:
            p.kill()
            p.wait()
        raise
    return scribblers


def check_scribbled_rings_hold_neither_admission_nor_shutdown(ctx):
    assert HOSTILE and os.access(HOSTILE, os.X_OK), f"KVSTASH_HOSTILE_RING={HOSTILE!r}"
    with FreshDaemon() as d:
        scribblers = []
        try:
            for _ in range(ROUNDS):
                for p in scribblers:
                    p.kill()
                    p.wait()
                scribblers = end_scribbled_sessions(d)
            t0 = time.monotonic()
            d.stop(timeout=STOP_LIMIT_S)
            print(f"     SIGTERM -> exit 0 in {(time.monotonic() - t0) * 1000:.0f} ms "
                  f"with the scribblers still writing", flush=True)
        finally:
            for p in scribblers:
                p.kill()
                p.wait()


def check_ring_call_returns_unavailable_when_kvstashd_dies(ctx):
    with FreshDaemon() as d:
        # A deadline far beyond the limit: only noticing the death can pass.
        w = subprocess.Popen([HOSTILE, "blocked", d.sock], env=worker_env(10 * 1000),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert read_line(w, 10.0, "blocked worker") == "READY"
            d.proc.send_signal(signal.SIGSTOP)  # no answer will come
            wait_stopped(d.proc.pid)
            w.stdin.write(b"go\n")
            w.stdin.flush()
            time.sleep(0.3)  # past the spin: the call sleeps on the futex
            assert w.poll() is None, "the ring call returned although kvstashd is stopped"
            d.proc.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            d.proc.wait()
            # The clock starts when kvstashd is reaped: the kernel closes its
            # sockets only after tearing down its memory, which for a
            # sanitizer build on a loaded machine alone can take over a second.
            t0 = time.monotonic()
            line = read_line(w, 15.0, "blocked worker")
            took = time.monotonic() - t0
            assert line.startswith("RESULT rc="), line
            rc = int(line.split()[1].removeprefix("rc="))
            assert rc == KVS_ERR_UNAVAILABLE, f"{line}: expected rc={KVS_ERR_UNAVAILABLE}"
            assert took < DEATH_LIMIT_S, \
                f"the call returned {took:.2f} s after kvstashd was reaped ({line})"
            print(f"     UNAVAILABLE {took * 1000:.0f} ms after kvstashd was reaped, "
                  f"{(t0 - t_kill) * 1000:.0f} ms from SIGKILL to reaped ({line})", flush=True)
            assert w.wait(5) == 0
        finally:
            w.kill()
            w.wait()


def check_statistics_rewritten_during_steps(ctx):
    with FreshDaemon() as d:
        racers = [subprocess.Popen([HOSTILE, "racer", d.sock, policy], stdout=subprocess.PIPE)
                  for policy in ("h2o", "tova", "ov_block")]
        try:
            for p in racers:
                line = read_line(p, 90.0, "racer")
                assert line.startswith("RACER ok"), line
                assert p.wait(5) == 0
                print(f"     {line}", flush=True)
        finally:
            for p in racers:
                p.kill()
                p.wait()
        honest = subprocess.run([HOSTILE, "honest", d.sock], capture_output=True, timeout=30)
        assert honest.returncode == 0, honest.stderr.decode()
        assert d.health() == SERVING


if __name__ == "__main__":
    sys.exit(run_tests("test_hostile_ring", [
        check_scribbled_rings_hold_neither_admission_nor_shutdown,
        check_ring_call_returns_unavailable_when_kvstashd_dies,
        check_statistics_rewritten_during_steps,
    ], time_limit=120))
