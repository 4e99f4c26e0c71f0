"""kvstash_harness.py - the real kvstashd under test, spoken to over the wire.

Used by the integration tests (tests/integration/test_*.py), which ctest runs
with Debian's /usr/bin/python3 (it has python3-grpcio) and these variables
(tests/CMakeLists.txt): KVSTASHD (the daemon binary), KVSTASH_BUILD_DIR, and
KVSTASH_TEST_BACKEND (the daemon's --backend, default host) and
PYTHONPATH with the stubs that protoc + grpc_python_plugin generated into
<build>/tests/py -- an implementation of gRPC and protobuf independent of the
daemon's gRPC C core + protobuf-c.

    d = Daemon(); d.start()          # fresh temp socket dir, --pool-mb 16, debug log
    w = Worker(d); w.attach("m", geometry(...))
    expect_status(d.store.Append, pb.AppendRequest(...), grpc.StatusCode.NOT_FOUND,
                  metadata=w.md)
    d.stop()                         # SIGTERM; asserts exit status 0 within 10 s

run_tests() runs a list of check functions, prints "N passed, M failed" and
returns the process exit status.
"""
import array
import atexit
import faulthandler
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import grpc

from kvstash.v1 import store_pb2 as pb
from kvstash.v1 import store_pb2_grpc as pb_grpc


def _load_health_pb2():
    # The stubs live in <py>/grpc/health/v1/, but the name `grpc` belongs to
    # grpcio itself, so `import grpc.health.v1.health_pb2` cannot find them:
    # load the generated module from its file instead.
    dirs = list(sys.path)
    if os.environ.get("KVSTASH_BUILD_DIR"):
        dirs.append(os.path.join(os.environ["KVSTASH_BUILD_DIR"], "tests", "py"))
    for d in dirs:
        path = os.path.join(d or ".", "grpc", "health", "v1", "health_pb2.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("kvstash_health_pb2", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise ImportError("grpc/health/v1/health_pb2.py not found on PYTHONPATH "
                      "(build the kvstash_py_stubs target)")


health_pb2 = _load_health_pb2()
SERVING = health_pb2.HealthCheckResponse.SERVING
TOKEN_RE = re.compile(r"[0-9a-f]{32}")
RPC_TIMEOUT = 5.0
_daemons = []  # every Daemon started by this process: killed at exit if still running


@atexit.register
def _kill_daemons():
    for d in _daemons:
        d.kill()


def geometry(layers=2, q_heads=4, kv_heads=2, head_dim=8, dtype=pb.DTYPE_FP32,
             block_tokens=16, rope_theta=0.0):
    """A Geometry message; the defaults are the tests' "wire" model."""
    return pb.Geometry(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                       dtype=dtype, block_tokens=block_tokens, rope_theta=rope_theta)


def wait_until(pred, timeout, what):
    """pred()'s first true value, polling every 50 ms; AssertionError naming
    `what` if none comes within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def fd_hello(sock_path, timeout=RPC_TIMEOUT):
    """The fd-socket handshake of docs/protocol.md: connect to PATH.fd
    (SOCK_SEQPACKET), send "HELLO 1", expect "OK <32 hex digits>".
    Returns (socket, token). Keep the socket object alive: closing it ends
    the session."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(sock_path + ".fd")
    s.send(b"HELLO 1")
    reply = s.recv(256).decode("ascii", "replace")
    assert reply.startswith("OK "), f"fd socket: HELLO 1 answered {reply!r}, expected 'OK <token>'"
    token = reply[3:].strip()
    assert TOKEN_RE.fullmatch(token), f"fd socket: token {token!r} is not 32 lowercase hex digits"
    return s, token


def fd_request(s, text):
    """Send one fd-socket message; return (reply text, [received fds])."""
    s.send(text.encode("ascii"))
    fds = array.array("i")
    msg, anc, _flags, _addr = s.recvmsg(256, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
    return msg.decode("ascii", "replace"), list(fds)


def expect_status(method, request, code, metadata=None, what=None):
    """Call `method` (a stub method or channel.unary_unary) and assert that it
    fails with `code`. Returns the status details (str)."""
    what = what or getattr(method, "_method", b"call")
    try:
        resp = method(request, timeout=RPC_TIMEOUT, metadata=metadata)
    except grpc.RpcError as e:
        assert e.code() == code, (f"{what}: expected {code.name}, got {e.code().name}: "
                                  f"{e.details()!r}")
        return e.details() or ""
    raise AssertionError(f"{what}: expected {code.name}, got OK: {str(resp).strip()!r}")


def call(method, request, metadata=None, what=None):
    """Call `method` and assert it succeeds; returns the reply."""
    try:
        return method(request, timeout=RPC_TIMEOUT, metadata=metadata)
    except grpc.RpcError as e:
        raise AssertionError(f"{what or 'call'}: expected OK, got {e.code().name}: "
                             f"{e.details()!r}") from None


class Daemon:
    """One kvstashd on a fresh temporary socket directory."""

    def __init__(self, pool_mb=16, log_level="debug", extra_args=(), wrapper=(), backend=None):
        self.binary = os.environ.get("KVSTASHD")
        assert self.binary and os.access(self.binary, os.X_OK), \
            f"KVSTASHD={self.binary!r} is not an executable (run through ctest)"
        self.dir = tempfile.mkdtemp(prefix="kvstash-test.")
        self.sock = os.path.join(self.dir, "kvstashd.sock")
        self.log_path = os.path.join(self.dir, "kvstashd.log")
        # wrapper: a command the daemon runs under (valgrind, for instance).
        # KVSTASH_TEST_BACKEND (ctest's integration-shadow/ runs) picks the
        # memory backend: "shadow" makes any direct access to pool memory,
        # in the daemon or in a worker, fault (README, "The shadow backend").
        self.backend = backend or os.environ.get("KVSTASH_TEST_BACKEND", "host")
        self.args = [*wrapper, self.binary, "--socket", self.sock, "--pool-mb", str(pool_mb),
                     "--log-level", log_level, "--backend", self.backend, *extra_args]
        self.proc = None
        self.channel = None
        self.store = None

    def start(self, timeout=30.0):
        """Start the daemon; return once Health/Check answers SERVING."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        _daemons.append(self)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise AssertionError(f"kvstashd exited with {self.proc.returncode} before "
                                     f"creating {self.sock}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"kvstashd did not create {self.sock} in {timeout} s\n"
                                     f"{self.log_tail()}")
            time.sleep(0.02)
        self.channel = grpc.insecure_channel("unix:" + self.sock)
        self.store = pb_grpc.StoreStub(self.channel)
        self._check = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        last = None
        while time.monotonic() < deadline:
            try:
                if self.health() == SERVING:
                    return self
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"kvstashd never answered Health SERVING (last: {last}, "
                             f"exit: {self.proc.poll()})\n{self.log_tail()}")

    def health(self, service=""):
        """Health/Check status for `service` (raises grpc.RpcError on error)."""
        return self._check(health_pb2.HealthCheckRequest(service=service),
                           timeout=RPC_TIMEOUT).status

    def check_method(self):
        return self._check

    def raw_method(self, name):
        """A bytes-in, bytes-out unary method, e.g. raw_method('/kvstash.v1.Store/Append')."""
        return self.channel.unary_unary(name, request_serializer=lambda x: x,
                                        response_deserializer=lambda x: x)

    def stats(self):
        return call(self.store.Stats, pb.StatsRequest(), what="Stats")

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def log_tail(self, lines=30):
        try:
            text = self.log().splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "--- kvstashd log (tail) ---\n" + "\n".join(text)

    def stop(self, timeout=60.0):
        """SIGTERM the daemon (workers may still be connected) and assert that
        it exits with status 0 within `timeout`."""
        assert self.proc is not None, "kvstashd was never started"
        if self.proc.poll() is not None:
            raise AssertionError(f"kvstashd had already exited with status "
                                 f"{self.proc.returncode}\n{self.log_tail()}")
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"kvstashd did not exit within {timeout} s of SIGTERM\n"
                                 f"{self.log_tail()}") from None
        finally:
            if self.channel is not None:
                self.channel.close()
                self.channel = None
        assert rc == 0, f"kvstashd exited with status {rc} after SIGTERM\n{self.log_tail()}"

    def kill(self):
        """Best-effort cleanup for error paths."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class Worker:
    """A worker identity: an fd-socket connection with its token, and
    optionally an attached session with an open Lease stream."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.fd_sock, self.token = fd_hello(daemon.sock)
        self.md = (("kvstash-token", self.token),)
        self.attached = None
        self.lease = None
        self.lease_first = None

    def attach(self, model="wire", geom=None, name="py-worker", lease=True):
        """Attach (asserting OK) and, by default, open the Lease stream and
        wait for its first message. Returns the AttachResponse."""
        req = pb.AttachRequest(model=model, geometry=geom or geometry(), worker_name=name)
        self.attached = call(self.daemon.store.Attach, req, self.md, what=f"Attach {model}")
        if lease:
            self.open_lease()
        return self.attached

    def open_lease(self, timeout=RPC_TIMEOUT):
        """Open the Lease stream; returns its first LeaseMessage."""
        self.lease = self.daemon.store.Lease(pb.LeaseRequest(), metadata=self.md)
        box = {}

        def first():
            try:
                box["msg"] = next(self.lease)
            except Exception as e:  # noqa: BLE001 - reported below
                box["err"] = e

        t = threading.Thread(target=first, daemon=True)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), f"Lease: no first message within {timeout} s"
        if "err" in box:
            e = box["err"]
            detail = f"{e.code().name}: {e.details()!r}" if isinstance(e, grpc.RpcError) else repr(e)
            raise AssertionError(f"Lease failed: {detail}")
        self.lease_first = box["msg"]
        return self.lease_first

    def close(self):
        if self.lease is not None:
            self.lease.cancel()
            self.lease = None
        self.fd_sock.close()


def run_tests(name, checks, daemon_kwargs=None, time_limit=240):
    """Start a daemon, run every check(ctx) in order, stop the daemon (itself
    a check), print a summary and return the exit status (0 = all passed).
    ctx is a plain namespace with .daemon; checks may store state on it.
    Under ctest, the watchdog fires 20 s before ctest's TIMEOUT
    (KVSTASH_TEST_TIMEOUT, tests/CMakeLists.txt), whatever time_limit says."""
    ctx_daemons = []
    if os.environ.get("KVSTASH_TEST_TIMEOUT"):
        time_limit = max(10, int(os.environ["KVSTASH_TEST_TIMEOUT"]) - 20)

    def overtime():  # stop before ctest's TIMEOUT kills us and orphans the daemon
        print(f"FAIL {name}: still running after {time_limit} s; stacks:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for d in ctx_daemons:
            d.kill()
            print(d.log_tail(40), flush=True)
        print(f"{name}: {passed} passed, {failed + 1} failed", flush=True)
        os._exit(1)

    watchdog = threading.Timer(time_limit, overtime)
    watchdog.daemon = True
    watchdog.start()

    class Ctx:
        pass

    ctx = Ctx()
    passed = failed = 0
    ctx.daemon = Daemon(**(daemon_kwargs or {}))
    ctx_daemons.append(ctx.daemon)
    print(f"{name}: kvstashd {ctx.daemon.binary}, socket {ctx.daemon.sock}", flush=True)
    try:
        ctx.daemon.start()
    except AssertionError as e:
        print(f"FAIL start: {e}")
        watchdog.cancel()
        ctx.daemon.kill()
        print(f"{name}: 0 passed, 1 failed")
        return 1

    def run_one(title, fn):
        nonlocal passed, failed
        began = time.monotonic()
        try:
            fn()
            passed += 1
            print(f"ok   {title} ({time.monotonic() - began:.1f} s)", flush=True)
        except AssertionError as e:
            failed += 1
            print(f"FAIL {title}: {e}", flush=True)
        except Exception:  # noqa: BLE001 - a crash in a check is a failure too
            failed += 1
            print(f"FAIL {title}: unexpected exception\n{traceback.format_exc()}", flush=True)

    for fn in checks:
        title = fn.__name__.removeprefix("check_").replace("_", " ")
        run_one(title, lambda fn=fn: fn(ctx))
    run_one("daemon exits 0 on SIGTERM", ctx.daemon.stop)
    for w in getattr(ctx, "workers", []):
        try:
            w.close()
        except Exception:  # noqa: BLE001
            pass
    ctx.daemon.kill()
    if failed:
        print(ctx.daemon.log_tail(60))
        print(f"(daemon log kept in {ctx.daemon.log_path})")
    else:
        ctx.daemon.cleanup()
    watchdog.cancel()
    print(f"{name}: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1
