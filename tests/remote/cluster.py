#!/usr/bin/env python3
"""A throwaway Redis Cluster on 127.0.0.1 for the remote tier's tests.

Standard library only; a module and a command line:

    cluster.py start DIR [--masters 3] [--replicas 1] [--owner PID]
                                                         prints "PORTS p1,p2,..."; with
                                                         --owner, stopped when PID exits
    cluster.py stop DIR                                  kills every server of DIR
    cluster.py plain DIR                                 a non-cluster server: "PORT p"
    cluster.py masters DIR | replicas DIR PORT           "PORTS p1,..." (live nodes)
    cluster.py owner DIR SLOT                            "PORT p" of the slot's master
    cluster.py kill DIR PORT | restart DIR PORT          SIGKILL / start again
    cluster.py wait-ok DIR [PORT] [--timeout S]          cluster_state:ok on PORT (or all)
    cluster.py wait-failover DIR DEADPORT [--timeout S]  a replica took over DEADPORT's slots
    cluster.py maxmemory DIR BYTES                       on every node, noeviction
    cluster.py sync DIR                                  WAIT: masters' writes reached replicas
    cluster.py migrate DIR SLOT DSTPORT                  move a slot (all three steps below)
    cluster.py migrate-begin DIR SLOT DSTPORT            SETSLOT IMPORTING / MIGRATING
    cluster.py migrate-keys DIR SLOT DSTPORT [KEY...]    MIGRATE these keys (none: all)
    cluster.py migrate-finish DIR SLOT DSTPORT           the rest, then SETSLOT NODE everywhere
    cluster.py cmd DIR PORT ARG...                       one command, its reply printed

Servers run daemonized (--daemonize yes) with their pidfiles, logs, and
cluster configs in DIR, on random free ports below the kernel's ephemeral
ports with their cluster bus (port+10000) too (10000-22767 on Linux's
default range), bound to 127.0.0.1 only. Every wait is bounded; `stop`
always cleans up, whatever state DIR is in. Errors: exit status 1 and one
line on stderr (ClusterError in Python).
"""

import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

NODE_TIMEOUT_MS = 1000  # failover within a few seconds


class ClusterError(Exception):
    pass


class RespError(Exception):
    """An error reply (-ERR ..., -MOVED ...) from a server."""


# ---- RESP --------------------------------------------------------------------


class Conn:
    """One blocking RESP2 connection to 127.0.0.1:port."""

    def __init__(self, port, timeout=5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.f = self.sock.makefile("rb")

    def close(self):
        self.f.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        return self._read()

    def _read(self):
        line = self.f.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("connection closed")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            raise RespError(body.decode(errors="replace"))
        if kind == b":":
            return int(body)
        if kind == b"$":
            n = int(body)
            return None if n < 0 else self.f.read(n + 2)[:-2]
        if kind == b"*":
            n = int(body)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise ConnectionError("bad reply %r" % line[:40])


def call(port, *args, timeout=5.0):
    with Conn(port, timeout) as c:
        return c.call(*args)


def info(port, section):
    text = call(port, "INFO", section).decode()
    return dict(l.split(":", 1) for l in text.splitlines() if ":" in l)


def cluster_info(port):
    text = call(port, "CLUSTER", "INFO").decode()
    return dict(l.split(":", 1) for l in text.splitlines() if ":" in l)


def crc16(data):
    """CRC16-XMODEM, as Redis Cluster's key slots."""
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key):
    key = key if isinstance(key, bytes) else key.encode()
    s = key.find(b"{")
    if s >= 0:
        e = key.find(b"}", s + 1)
        if e > s + 1:
            key = key[s + 1 : e]
    return crc16(key) % 16384


# ---- processes ---------------------------------------------------------------


def _need(prog):
    path = shutil.which(prog)
    if path is None:
        raise ClusterError("%s not found: run ops/setup.sh (it installs redis-server and "
                           "redis-tools)" % prog)
    return path


def _pidfile(d, port, kind="redis"):
    return os.path.join(d, "%s-%d.pid" % (kind, port))


def _pid_alive(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return b"redis-server" in f.read()
    except OSError:
        return False


def _read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _port_free(port):
    for p in (port, port + 10000):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return False
        finally:
            s.close()
    return True


def _port_range():
    """Where a node's port and its bus port (port+10000) both lie below the
    kernel's ephemeral ports. A bus port among them can be taken, while its
    node is down, as the local port of any connection on the machine, and
    the node then cannot restart (bind: Address already in use; a CI run
    of test_remote met it)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    hi = min(lo - 10000, 30000)
    return (10000, hi) if hi - 10000 >= 2000 else (20000, 30000)


def _pick_ports(n, taken=()):
    rng = random.Random(os.getpid() ^ time.time_ns())
    lo, hi = _port_range()
    ports = []
    for _ in range(2000):
        p = rng.randrange(lo, hi)
        if p not in ports and p not in taken and _port_free(p):
            ports.append(p)
            if len(ports) == n:
                return ports
    raise ClusterError("no %d free ports (with port+10000) in %d-%d" % (n, lo, hi - 1))


def _server_args(d, port, cluster):
    args = [_need("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
            "--protected-mode", "yes", "--appendonly", "no", "--save", "",
            "--dir", d, "--daemonize", "yes",
            "--pidfile", _pidfile(d, port, "redis" if cluster else "plain"),
            "--logfile", os.path.join(d, "redis-%d.log" % port),
            "--enable-debug-command", "local"]
    if cluster:
        args += ["--cluster-enabled", "yes",
                 "--cluster-config-file", os.path.join(d, "nodes-%d.conf" % port),
                 "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
    return args


def _launch(d, port, cluster=True):
    r = subprocess.run(_server_args(d, port, cluster), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=15)
    if r.returncode != 0:
        raise ClusterError("redis-server on port %d failed: %s" %
                           (port, r.stdout.decode(errors="replace").strip()[-300:]))


def _until(what, fn, timeout):
    """Poll fn() every 50 ms until it returns true; ClusterError after timeout s."""
    end = time.monotonic() + timeout
    last = None
    while True:
        try:
            if fn():
                return
        except (OSError, RespError, ValueError) as e:
            last = e
        if time.monotonic() > end:
            raise ClusterError("timed out after %.0f s waiting for %s%s" %
                               (timeout, what, " (last: %s)" % last if last else ""))
        time.sleep(0.05)


def _wait_ping(port, timeout=10):
    _until("redis-server on port %d" % port, lambda: call(port, "PING", timeout=1) == "PONG",
           timeout)


# ---- state -------------------------------------------------------------------


def _state(d):
    try:
        with open(os.path.join(d, "cluster.json")) as f:
            return json.load(f)
    except OSError:
        raise ClusterError("no cluster in %s (start it first)" % d)


def ports(d):
    return _state(d)["ports"]


def live_ports(d):
    return [p for p in ports(d) if _pid_alive(_read_pid(_pidfile(d, p)))]


def _any_live(d):
    for p in live_ports(d):
        try:
            call(p, "PING", timeout=1)
            return p
        except (OSError, RespError):
            pass
    raise ClusterError("no live node in %s" % d)


def nodes(port):
    """CLUSTER NODES of port: a list of dicts (id, port, flags, master, slots)."""
    out = []
    for line in call(port, "CLUSTER", "NODES").decode().splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        addr = f[1].split("@")[0]
        out.append({"id": f[0], "port": int(addr.rsplit(":", 1)[1]), "flags": f[2].split(","),
                    "master": f[3], "slots": f[8:]})
    return out


def node_id(port):
    return call(port, "CLUSTER", "MYID").decode()


def owner(d, slot, via=None):
    """The port of the master that owns slot, as node `via` (any live) sees it."""
    for r in call(via or _any_live(d), "CLUSTER", "SLOTS"):
        if r[0] <= slot <= r[1]:
            return r[2][1]
    raise ClusterError("slot %d has no owner" % slot)


def masters(d):
    """Live masters that own slots, by port."""
    ns = nodes(_any_live(d))
    live = set(live_ports(d))
    return sorted(n["port"] for n in ns
                  if "master" in n["flags"] and n["slots"] and "fail" not in n["flags"]
                  and n["port"] in live)


def replicas(d, port):
    """Live replicas of the master on port."""
    ns = nodes(_any_live(d))
    mid = next((n["id"] for n in ns if n["port"] == port), None)
    live = set(live_ports(d))
    return sorted(n["port"] for n in ns if n["master"] == mid and n["port"] in live)


# ---- lifecycle ---------------------------------------------------------------


def wait_ok(d, port=None, timeout=30):
    """cluster_state:ok as `port` sees it (every live node when None)."""
    targets = [port] if port else live_ports(d)
    for p in targets:
        _until("cluster_state:ok on port %d" % p,
               lambda: cluster_info(p).get("cluster_state") == "ok", timeout)


def _replicas_linked(d, n):
    for p in live_ports(d):
        inf = info(p, "replication")
        if inf.get("role") == "master" and int(inf.get("connected_slaves", 0)) < n:
            return False
        if inf.get("role") == "slave" and inf.get("master_link_status") != "up":
            return False
    return True


def _watch(d, owner_pid):
    """Stop d's servers once owner_pid has exited (killed, crashed) while
    the cluster is still there; return as soon as d's cluster is stopped."""
    state = os.path.join(d, "cluster.json")
    while os.path.exists(state):
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            stop(d)
            return
        except PermissionError:
            pass
        time.sleep(0.5)


def _spawn_watchdog(d, owner_pid):
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "watch", d, str(owner_pid)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def start(d, masters_n=3, replicas_n=1, timeout=30, owner_pid=None):
    """Start masters_n * (1 + replicas_n) nodes in d and make them one cluster.
    With owner_pid, a watchdog process stops them when that process exits
    without stopping them itself (a crashed or killed test)."""
    _need("redis-server")
    cli = _need("redis-cli")
    if masters_n < 3:
        raise ClusterError("a Redis Cluster needs at least 3 masters")
    os.makedirs(d, exist_ok=True)
    ps = _pick_ports(masters_n * (1 + replicas_n))
    with open(os.path.join(d, "cluster.json"), "w") as f:
        json.dump({"ports": ps, "masters": masters_n, "replicas": replicas_n}, f)
    try:
        for p in ps:
            _launch(d, p)
        for p in ps:
            _wait_ping(p)
        with open(os.path.join(d, "create.log"), "wb") as log:
            r = subprocess.run([cli, "--cluster", "create"] + ["127.0.0.1:%d" % p for p in ps] +
                               ["--cluster-replicas", str(replicas_n), "--cluster-yes"],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               timeout=timeout)
        if r.returncode != 0:
            raise ClusterError("redis-cli --cluster create failed (see %s/create.log)" % d)
        wait_ok(d, timeout=timeout)
        _until("every node to know all %d" % len(ps),
               lambda: all(int(cluster_info(p)["cluster_known_nodes"]) == len(ps) for p in ps),
               timeout)
        _until("replicas linked", lambda: _replicas_linked(d, replicas_n), timeout)
        if owner_pid:
            _spawn_watchdog(d, owner_pid)
    except BaseException:
        stop(d)
        raise
    return ps


def start_plain(d):
    """A redis-server without cluster mode; its port."""
    os.makedirs(d, exist_ok=True)
    taken = []
    try:
        taken = ports(d)
    except ClusterError:
        pass
    p = _pick_ports(1, taken)[0]
    _launch(d, p, cluster=False)
    _wait_ping(p)
    return p


def _kill_pidfile(path, timeout=10):
    pid = _read_pid(path)
    if pid > 0 and _pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _until("pid %d to exit" % pid, lambda: not _pid_alive(pid), timeout)
    try:
        os.unlink(path)
    except OSError:
        pass


def kill(d, port):
    """SIGKILL the node on port."""
    path = _pidfile(d, port)
    if not _pid_alive(_read_pid(path)):
        raise ClusterError("no live node on port %d in %s" % (port, d))
    _kill_pidfile(path)


def restart(d, port):
    """Start the node on port again (same config file, so same identity).
    A node that does not answer: the end of its log in the error."""
    _launch(d, port)
    try:
        _wait_ping(port)
    except ClusterError as e:
        try:
            with open(os.path.join(d, "redis-%d.log" % port), errors="replace") as f:
                tail = f.read()[-300:].strip()
        except OSError:
            tail = "(no log)"
        raise ClusterError("%s; its log ends: %s" % (e, tail)) from None


def stop(d):
    """Kill every server whose pidfile is in d; never fails."""
    errors = []
    for path in glob.glob(os.path.join(d, "redis-*.pid")) + \
            glob.glob(os.path.join(d, "plain-*.pid")):
        try:
            _kill_pidfile(path)
        except ClusterError as e:
            errors.append(str(e))
    try:
        os.unlink(os.path.join(d, "cluster.json"))  # ends the watchdog
    except OSError:
        pass
    if errors:
        raise ClusterError("; ".join(errors))


def keys(d, pattern):
    """Every key matching pattern, from every master, sorted (str)."""
    found = []
    for p in masters(d):
        found += [k.decode() if isinstance(k, bytes) else k for k in call(p, "KEYS", pattern)]
    return sorted(found)


def hang(port, seconds):
    """Start a thread that makes the node on port sleep (DEBUG SLEEP), so
    that a call to it is in flight when a test kills it; returns the
    thread (join it). A node killed while it sleeps is what the test wants."""
    def sleep():
        try:
            call(port, "DEBUG", "SLEEP", str(seconds), timeout=seconds + 7)
        except Exception:  # noqa: BLE001 - killed while sleeping, as intended
            pass
    t = threading.Thread(target=sleep)
    t.start()
    return t


def rejoin(d, port, timeout=30):
    """The node on port, killed, back: as a replica of the master that
    replaced it; the cluster ok again."""
    restart(d, port)
    _until("port %d to rejoin as a replica" % port, lambda: _replicas_linked(d, 1), timeout)
    wait_ok(d)


def wait_failover(d, dead, timeout=30):
    """Until every live node reports cluster_state:ok with no slot on `dead`."""
    def done():
        for p in live_ports(d):
            if cluster_info(p).get("cluster_state") != "ok":
                return False
            if any(r[2][1] == dead for r in call(p, "CLUSTER", "SLOTS")):
                return False
        return True
    _until("a replica to take over port %d's slots" % dead, done, timeout)


def set_maxmemory(d, nbytes):
    """On every live node (replicas too, in case one is promoted)."""
    for p in live_ports(d):
        call(p, "CONFIG", "SET", "maxmemory-policy", "noeviction")
        call(p, "CONFIG", "SET", "maxmemory", str(nbytes))


def _key_on(d, port, prefix):
    """A key whose slot the master on port owns."""
    ranges = [(r[0], r[1]) for r in call(port, "CLUSTER", "SLOTS") if r[2][1] == port]
    for i in range(100000):
        k = "%s%d" % (prefix, i)
        s = key_slot(k)
        if any(a <= s <= b for a, b in ranges):
            return k
    raise ClusterError("no key found for port %d" % port)


def sync_replicas(d, timeout_ms=5000):
    """Every master's writes so far reached its replicas: a write on each,
    then WAIT for them (WAIT counts this connection's writes, and a
    replica applies the stream in order)."""
    for p in masters(d):
        want = len(replicas(d, p))
        if want == 0:
            continue
        with Conn(p, timeout_ms / 1000 + 5) as c:
            c.call("SET", _key_on(d, p, "__sync__"), "1")
            got = c.call("WAIT", want, timeout_ms)
        if got < want:
            raise ClusterError("port %d: %d of %d replicas acknowledged" % (p, got, want))


# ---- slot migration (spec: "Cluster live reconfiguration") ---------------------


def migrate_begin(d, slot, dst):
    src = owner(d, slot)
    if src == dst:
        raise ClusterError("slot %d is already on port %d" % (slot, dst))
    call(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(src))
    call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(dst))
    return src


def _source(d, slot, dst):
    """The node migrating slot to dst (the owner in the map until the end)."""
    src = owner(d, slot, via=dst)
    if src == dst:
        raise ClusterError("slot %d is not migrating to port %d" % (slot, dst))
    return src


def migrate_keys(d, slot, dst, keys=None):
    src = _source(d, slot, dst)
    with Conn(src, 30) as c:
        while True:
            batch = keys if keys is not None else c.call("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if batch:
                c.call("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *batch)
            if keys is not None or not batch:
                return


def migrate_finish(d, slot, dst):
    src = _source(d, slot, dst)
    migrate_keys(d, slot, dst)
    dst_id = node_id(dst)
    # Spec: the destination first, then the source, then the others.
    order = [dst, src] + [p for p in masters(d) if p not in (dst, src)]
    for p in order:
        call(p, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    _until("every node to see slot %d on port %d" % (slot, dst),
           lambda: all(owner(d, slot, via=p) == dst for p in live_ports(d)), 15)


def migrate_slot(d, slot, dst):
    migrate_begin(d, slot, dst)
    migrate_finish(d, slot, dst)


# ---- command line --------------------------------------------------------------


def _fmt(v):
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list):
        return "\n".join(_fmt(x) for x in v)
    return str(v)


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, d, rest = argv[1], argv[2], argv[3:]
    if d.startswith("-") or not d:
        raise ClusterError("DIR must come right after the command, got %r" % d)
    opt = {}
    pos = []
    i = 0
    while i < len(rest):
        if rest[i].startswith("--") and cmd != "cmd" and i + 1 < len(rest):
            opt[rest[i][2:]] = rest[i + 1]
            i += 2
        else:
            pos.append(rest[i])
            i += 1
    t = float(opt.get("timeout", 30))
    if cmd == "start":
        ps = start(d, int(opt.get("masters", 3)), int(opt.get("replicas", 1)),
                   owner_pid=int(opt["owner"]) if "owner" in opt else None)
        print("PORTS " + ",".join(map(str, ps)))
    elif cmd == "stop":
        stop(d)
    elif cmd == "watch":
        _watch(d, int(pos[0]))
        return 0
    elif cmd == "plain":
        print("PORT %d" % start_plain(d))
    elif cmd == "masters":
        print("PORTS " + ",".join(map(str, masters(d))))
    elif cmd == "replicas":
        print("PORTS " + ",".join(map(str, replicas(d, int(pos[0])))))
    elif cmd == "owner":
        print("PORT %d" % owner(d, int(pos[0])))
    elif cmd == "kill":
        kill(d, int(pos[0]))
    elif cmd == "restart":
        restart(d, int(pos[0]))
    elif cmd == "wait-ok":
        wait_ok(d, int(pos[0]) if pos else None, t)
    elif cmd == "wait-failover":
        wait_failover(d, int(pos[0]), t)
    elif cmd == "maxmemory":
        set_maxmemory(d, int(pos[0]))
    elif cmd == "sync":
        sync_replicas(d)
    elif cmd == "migrate":
        migrate_slot(d, int(pos[0]), int(pos[1]))
    elif cmd == "migrate-begin":
        migrate_begin(d, int(pos[0]), int(pos[1]))
    elif cmd == "migrate-keys":
        migrate_keys(d, int(pos[0]), int(pos[1]), pos[2:] or None)
    elif cmd == "migrate-finish":
        migrate_finish(d, int(pos[0]), int(pos[1]))
    elif cmd == "cmd":
        print(_fmt(call(int(pos[0]), *pos[1:], timeout=t)))
    else:
        print("unknown command %r\n%s" % (cmd, __doc__), file=sys.stderr)
        return 2
    if cmd not in ("start", "plain", "masters", "replicas", "owner", "cmd"):
        print("OK")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except (ClusterError, RespError, OSError, subprocess.TimeoutExpired) as e:
        print("cluster.py: %s: %s" % (sys.argv[1] if len(sys.argv) > 1 else "", e),
              file=sys.stderr)
        sys.exit(1)
