"""Issue 12, problem 5: admission and liveness cannot be exhausted.

Each check is the hostile case that used to succeed against kvstashd:
  - connections that only say HELLO filled --max-sessions while Stats showed
    no session, and kept honest workers out for as long as they stayed open;
  - idle fd-socket connections piled up to the table's 4,096 slots;
  - at the fd limit the fd-socket thread spun on accept() (EMFILE);
  - a few dozen HTTP clients that send nothing held /healthz down;
  - a SIGSTOPped worker kept its session and its blocks forever.
docs/reliability.md explains the defences and what they leave open.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from kvstash_harness import Daemon, Worker, call, fd_hello, geometry, pb, run_tests, wait_until
from worker_procs import WorkerProc

PENDING_MS = 1500
MAX_SESSIONS = 32
MAX_PENDING = 48
FD_LIMIT = 64
CLI = os.environ.get("KVSTASH_CLI", "")


def closed_by_daemon(s, timeout=0.0):
    """Whether the daemon closed fd-socket connection s (EOF after at most an
    ERR message), waiting up to `timeout` seconds."""
    s.settimeout(timeout if timeout > 0 else 0.001)
    try:
        while True:
            data = s.recv(512)
            if data == b"":
                return True
            assert data.startswith(b"ERR "), f"unexpected fd-socket message {data!r}"
    except (socket.timeout, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


def raw_fd_connect(sock_path, timeout=0.5):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(sock_path + ".fd")
    return s


def check_hello_only_connections_show_as_pending_and_time_out(ctx):
    d = ctx.daemon
    squatters = [fd_hello(d.sock)[0] for _ in range(MAX_SESSIONS)]
    st = d.stats()
    assert st.pending_sessions == MAX_SESSIONS and len(st.sessions) == 0, \
        f"Stats: {st.pending_sessions} pending, {len(st.sessions)} sessions; expected " \
        f"{MAX_SESSIONS} pending"
    # Meanwhile the table is full: a new HELLO is refused with the reason.
    s = raw_fd_connect(d.sock, timeout=5.0)
    s.send(b"HELLO 1")
    reply = s.recv(256).decode()
    assert reply.startswith("ERR ") and "too many sessions" in reply, reply
    s.close()
    # Once they time out an honest worker gets in, and they are gone.
    t0 = time.monotonic()
    wait_until(lambda: all(closed_by_daemon(q) for q in squatters), PENDING_MS / 1000 * 3,
               "HELLO-only connections closed by the daemon")
    waited = time.monotonic() - t0
    assert waited >= PENDING_MS / 1000 * 0.5, f"closed after {waited:.2f} s, before the timeout"
    w = Worker(d)
    w.attach(name="honest")
    st = d.stats()
    assert st.pending_sessions == 0 and len(st.sessions) == 1, st
    # An attached worker is not pending: it outlives the pending timeout.
    time.sleep(PENDING_MS / 1000 * 1.5)
    assert not closed_by_daemon(w.fd_sock), "the daemon closed an attached worker's connection"
    assert [x.worker_name for x in d.stats().sessions] == ["honest"]
    w.close()
    for q in squatters:
        q.close()
    assert "pending_timeout" in d.log(), "no pending_timeout log line"


def check_idle_connections_are_capped_oldest_closed(ctx):
    d = ctx.daemon
    idle = [raw_fd_connect(d.sock) for _ in range(MAX_PENDING + 16)]
    # The 16 oldest made room for the newest: closed by the daemon.
    wait_until(lambda: all(closed_by_daemon(q) for q in idle[:16]), 3.0,
               "the oldest idle connections closed at the cap")
    assert not any(closed_by_daemon(q) for q in idle[16:]), "a newer idle connection was closed"
    # An honest worker still gets in at once, with the cap full of idle peers.
    w = Worker(d)
    w.attach(name="honest-2")
    assert closed_by_daemon(idle[16], timeout=1.0), "the oldest idle one made room for it"
    w.close()
    for q in idle:
        q.close()


def proc_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_accept_does_not_spin_at_the_fd_limit(ctx):
    d = Daemon(extra_args=("--pending-timeout-ms", "60000", "--max-pending", "4096"),
               wrapper=("prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--"))
    d.start()
    try:
        pid = d.proc.pid
        base = open_fds(d)
        assert base is None or base < FD_LIMIT - 16, \
            f"kvstashd starts with {base} fds; the test needs room"
        conns = []
        # Connect until the daemon is out of descriptors and its backlog full:
        # then connect() blocks (times out here), or the daemon sheds us.
        for _ in range(FD_LIMIT + 256):
            try:
                conns.append(raw_fd_connect(d.sock, timeout=0.2))
            except (socket.timeout, BlockingIOError, ConnectionRefusedError):
                break
        wait_until(lambda: (open_fds(d) or 0) >= FD_LIMIT - 2 or "fd_exhausted" in d.log(), 5.0,
                   "kvstashd at its fd limit")
        cpu0, t0 = proc_cpu_seconds(pid), time.monotonic()
        time.sleep(2.0)
        cpu = proc_cpu_seconds(pid) - cpu0
        wall = time.monotonic() - t0
        print(f"     at the fd limit ({len(conns)} connections): kvstashd used {cpu:.3f} s "
              f"CPU in {wall:.2f} s", flush=True)
        assert cpu < 0.2, f"kvstashd used {cpu:.2f} s of CPU in {wall:.2f} s at the fd limit"
        for q in conns:
            q.close()
        # It serves again once the connections are gone.
        w = wait_until(lambda: _try_worker(d), 10.0, "a worker attaches after the flood")
        w.close()
        assert "fd_exhausted" in d.log(), "no fd_exhausted log line"
        d.stop()
    finally:
        d.kill()
    d.cleanup()


def open_fds(d):
    """How many descriptors kvstashd holds; None when /proc does not say (it
    is not dumpable, and we are not root)."""
    try:
        return len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    except PermissionError:
        return None


def _try_worker(d):
    try:
        w = Worker(d)
        w.attach(name="after-flood")
        return w
    except (AssertionError, OSError):
        return None


def metrics_port(d):
    m = wait_until(lambda: re.search(r"metrics_listening addr=\S*:(\d+)", d.log()), 5.0,
                   "metrics_listening log line")
    return int(m.group(1))


def healthz(port, timeout=1.0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", "/healthz")
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def check_slow_http_clients_do_not_hold_healthz_down(ctx):
    port = metrics_port(ctx.daemon)
    slow = []
    for i in range(100):
        s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        if i % 2:
            s.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finishes the headers
        slow.append(s)
    for _ in range(3):
        t0 = time.monotonic()
        status, body = healthz(port)
        took = time.monotonic() - t0
        assert status == 200 and body == b"serving\n" and took < 1.0, (status, body, took)
        time.sleep(0.2)
    # The slow ones are cut after the connection timeout, not held forever.
    time.sleep(5.0)
    for s in slow:
        s.settimeout(0.01)
        try:
            data = s.recv(4096)
            assert data == b"" or data.startswith(b"HTTP/1.1 "), data
        except socket.timeout:
            raise AssertionError("a silent HTTP client still held its connection after 5 s")
        except ConnectionResetError:
            pass
        s.close()


def check_stopped_worker_is_reclaimed_after_the_lease(ctx):
    lease_ms = 1500
    d = Daemon(extra_args=("--lease-timeout-ms", str(lease_ms)))
    d.start()
    watch = subprocess.Popen([CLI, "--socket", d.sock, "watch", "--json", "--timeout", "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True)
    reader.start()
    stopped = None
    try:
        # nanomsg subscribes in the background: probe until the feed shows one.
        for _ in range(40):
            p = Worker(d)
            p.attach(name="probe")
            p.close()
            if _seen(lines, 0.5):
                break
        else:
            raise AssertionError("kvstash watch saw no probe worker")
        stopped = WorkerProc(d, "stopped", seed=5, tokens=64, step=16, hold=True)
        stopped.wait_line("READY")
        sid = stopped.session_id()
        # A worker that keeps calling keeps its lease: any call with its token.
        alive = Worker(d)  # on the same pool, which therefore outlives the stopped one
        alive.attach(model="itest", geom=geometry(layers=3, q_heads=4, kv_heads=2, head_dim=16,
                                                  block_tokens=8), name="alive")
        q = call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), alive.md)
        renew = pb.GetBlockTableRequest(seq_id=q.seq_id)
        st = d.stats()
        (pool,) = [p for p in st.pools if p.model == "itest"]
        pool_total = pool.blocks_total
        assert pool.blocks_free < pool_total, "the stopped worker holds no blocks"
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while time.monotonic() - t0 < lease_ms / 1000 * 3:
            if sid not in [s.session_id for s in d.stats().sessions]:
                break
            time.sleep(0.1)
            call(d.store.GetBlockTable, renew, alive.md, what="GetBlockTable (renews)")
        took = time.monotonic() - t0
        st = d.stats()
        ids = [s.session_id for s in st.sessions]
        assert sid not in ids, f"the stopped worker's session lives {took:.1f} s after SIGSTOP"
        assert took >= lease_ms / 1000 * 0.8, f"reclaimed after {took:.2f} s, before the lease"
        assert [s.worker_name for s in st.sessions] == ["alive"], st.sessions
        (pool,) = [p for p in st.pools if p.model == "itest"]
        assert pool.blocks_free == pool_total, f"{pool.blocks_free} of {pool_total} blocks free"
        assert not [x for x in st.sequences if x.session_id == sid], "its sequences remain"
        ev = wait_until(lambda: [json.loads(x) for x in list(lines)
                                 if json.loads(x)["topic"] == "worker.reclaimed"
                                 and json.loads(x)["session"] == sid], 5.0, "reclaim event")
        assert ev[0]["reason"] == "lease-timeout" and ev[0]["pid"] == stopped.proc.pid, ev
        assert re.search(rf"session={sid} .*reason=lease-timeout", d.log()), \
            "no log line for the lease timeout"
        alive.close()
        d.stop()
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGKILL)
            os.kill(stopped.proc.pid, signal.SIGCONT)
            stopped.proc.wait()
        watch.kill()
        watch.wait()
        d.kill()
    d.cleanup()


def _seen(lines, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any('"worker.reclaimed"' in x for x in list(lines)):
            return True
        time.sleep(0.05)
    return False


if __name__ == "__main__":
    sys.exit(run_tests("test_hostile_live", [
        check_hello_only_connections_show_as_pending_and_time_out,
        check_idle_connections_are_capped_oldest_closed,
        check_accept_does_not_spin_at_the_fd_limit,
        check_slow_http_clients_do_not_hold_healthz_down,
        check_stopped_worker_is_reclaimed_after_the_lease,
    ], daemon_kwargs={"extra_args": ("--max-sessions", str(MAX_SESSIONS), "--pending-timeout-ms",
                                     str(PENDING_MS), "--max-pending", str(MAX_PENDING),
                                     "--metrics", "127.0.0.1:0")}, time_limit=120))
