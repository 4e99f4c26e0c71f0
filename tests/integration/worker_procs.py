"""worker_procs.py - real worker processes (kvs_test_worker, linked with
libkvstash) started against a test daemon, for the integration tests."""
import json
import os
import subprocess
import time

GEOMETRY = ["--layers", "3", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--block-tokens", "8"]


class WorkerProc:
    """One kvs_test_worker process; stdout is read line by line."""

    def __init__(self, daemon, name, seed, tokens, step=1, policy="full", params=(),
                 sleep_ms=0, sequences=1, hold=False, model="itest", geometry=GEOMETRY,
                 dev_io=False):
        binary = os.environ.get("KVSTASH_TEST_WORKER")
        assert binary and os.access(binary, os.X_OK), \
            f"KVSTASH_TEST_WORKER={binary!r} is not an executable (run through ctest)"
        args = [binary, "--socket", daemon.sock, "--model", model, *geometry,
                "--policy", policy, "--tokens", str(tokens), "--step", str(step),
                "--seed", str(seed), "--sleep-ms", str(sleep_ms), "--sequences", str(sequences),
                "--verify-every", "1", "--name", name]
        for p in params:
            args += ["--set", p]
        if hold:
            args.append("--hold")
        if dev_io:
            args.append("--dev-io")
        self.name = name
        self.lines = []
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)

    def wait_line(self, prefix, timeout=30.0):
        """Read stdout until a line starts with `prefix`; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line == "":
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith(prefix):
                return line.rstrip("\n")
        raise AssertionError(f"{self.name}: no line starting with {prefix!r}; "
                             f"exit={self.proc.poll()} last lines={self.lines[-5:]} "
                             f"stderr={self.stderr_text()!r}")

    def stderr_text(self):
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read()

    def finish(self, timeout=60.0):
        """Close stdin (ends --hold), wait, and return the final JSON line."""
        out, err = self.proc.communicate(timeout=timeout)  # closes stdin
        self.lines += out.splitlines()
        assert self.proc.returncode == 0, (f"{self.name}: exit {self.proc.returncode}; "
                                           f"last lines={self.lines[-5:]} stderr={err!r}")
        result = json.loads(self.lines[-1])
        assert result["ok"] is True, f"{self.name}: {result}"
        return result

    def session_id(self):
        for line in self.lines:
            if line.startswith("ATTACHED "):
                fields = dict(kv.split("=") for kv in line.split()[1:])
                return int(fields["session"])
        raise AssertionError(f"{self.name}: no ATTACHED line yet")
