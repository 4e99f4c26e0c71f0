"""procs.py - the tests' other processes: Python workers (py_worker.py,
driven like tests/integration/worker_procs.py drives kvs_test_worker) and a
peer (peer.py) that looks at the pool through its own session."""
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

from worker_procs import GEOMETRY, WorkerProc

HERE = os.path.dirname(os.path.abspath(__file__))


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02):
    """Poll predicate() until it returns a true value (returned) or time runs
    out (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


class PyWorkerProc(WorkerProc):
    """A py_worker.py process: WorkerProc's interface (wait_line, finish,
    session_id) over the Python worker."""

    def __init__(self, daemon, name, seed, tokens, step=1, policy="full", params=(),
                 sleep_ms=0, sequences=1, hold=False, model="itest", geometry=GEOMETRY):
        args = [sys.executable, os.path.join(HERE, "py_worker.py"), "--socket", daemon.sock,
                "--model", model, *geometry, "--policy", policy, "--tokens", str(tokens),
                "--step", str(step), "--seed", str(seed), "--sleep-ms", str(sleep_ms),
                "--sequences", str(sequences), "--verify-every", "1", "--name", name]
        for p in params:
            args += ["--set", p]
        if hold:
            args.append("--hold")
        self.name = name
        self.lines: List[str] = []
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)


class Peer:
    """peer.py in another process: one JSON request per line, one JSON reply
    per line (see peer.py)."""

    def __init__(self, sock: str, model: str, geometry: Dict[str, Any]):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "peer.py"), sock, model,
                                      json.dumps(geometry)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.hello = self._reply()

    def _reply(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"peer.py exited {self.proc.wait()}: {self.proc.stderr.read()}")
        reply = json.loads(line)
        assert reply.get("ok"), reply
        return reply

    def call(self, **request) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)
        return self.proc.returncode
