"""test_backend_cuda.py - kvstashd --backend cuda, the parts that need no GPU.

The cuda backend keeps pools in GPU memory shared by CUDA IPC (docs/gpu.md).
What can be proven on a host without a device, with the real kvstashd:
  - a build without CUDA refuses --backend cuda, saying so;
  - a CUDA build without a usable device exits non-zero at start, with
    kv_devmem_probe's reason (the CUDA runtime's own words) in one log line,
    and leaves no socket behind;
  - --cuda-ipc and --cuda-device values that are not allowed are refused
    before anything starts, as flags and as config-file keys, with a message
    naming the allowed values;
  - --print-config shows the two keys, and a file of them reads back;
  - the host backend, started with the cuda keys set, still serves a worker
    that writes and verifies every token (the keys change nothing there).
With a device the start check is replaced by a worker run on the GPU pool;
the rest of the GPU checks are tests/gpu/run.sh's.
"""
import os
import re
import subprocess
import sys
import tempfile

from kvstash_harness import Daemon, run_tests
from worker_procs import WorkerProc

KVSTASHD = os.environ.get("KVSTASHD", "")
UUID = "GPU-01234567-89ab-cdef-f0e1-d2c3b4a59687"


def kvstashd(*args, timeout=60):
    return subprocess.run([KVSTASHD, *args], capture_output=True, text=True, timeout=timeout)


def built_with_cuda():
    """--print-config needs no device: it only parses (and refuses an unknown
    backend, which cuda is in a build without CUDA)."""
    return kvstashd("--backend", "cuda", "--print-config").returncode == 0


def check_backend_cuda_at_start(ctx):
    if not built_with_cuda():
        p = kvstashd("--backend", "cuda", "--socket", "/nonexistent/kvstashd.sock")
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert "this kvstashd was built without CUDA" in p.stderr, p.stderr
        print("  (build without CUDA: --backend cuda refused as such)")
        return
    d = tempfile.mkdtemp(prefix="kvstash-cuda.")
    sock = os.path.join(d, "kvstashd.sock")
    p = kvstashd("--backend", "cuda", "--socket", sock, "--log-level", "debug")
    if p.returncode == 0 or "no usable CUDA device" not in p.stderr + p.stdout:
        # kvstashd starts only with a device: it is serving (returncode 0 is
        # impossible for a serving daemon, which never exits by itself).
        raise AssertionError(f"unexpected: rc={p.returncode} {p.stdout} {p.stderr}")
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "start_failed" in ln]
    assert len(lines) == 1, p.stderr
    line = lines[0]
    assert "level=error" in line and "what=backend" in line and "backend=cuda" in line, line
    # The probe's reason: cudaGetDeviceCount's error name and text, or 0 devices.
    assert re.search(r"no usable CUDA device: cudaGetDeviceCount(: cudaError\w+ \(.+\)| found 0)",
                     line), line
    # Nothing was created: the check runs before the sockets and the lock.
    assert os.listdir(d) == [], os.listdir(d)
    os.rmdir(d)


def device_present():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_worker_on_gpu_pool(ctx):
    """Only with a GPU: the unchanged test worker on a cuda pool."""
    if not built_with_cuda() or not device_present():
        print("  SKIP worker on a cuda pool: no CUDA build or no device")
        return
    d = Daemon(backend="cuda")
    d.start()
    try:
        w = WorkerProc(d, "gpu", seed=7, tokens=96, step=5)
        r = w.finish()
        assert r["tokens"] == 96 and r["checked"] > 0, r
    finally:
        d.stop()


def check_bad_values_refused(ctx):
    cases = [
        (("--cuda-ipc", "bogus"), "cuda-ipc must be auto"),
        (("--cuda-ipc", "VMM"), "cuda-ipc must be auto"),
        (("--cuda-device", "garbage"), "cuda-device must be a device number"),
        (("--cuda-device", "-1"), "cuda-device must be a device number"),
        (("--cuda-device", "GPU-1234"), "cuda-device must be a device number"),
        (("--cuda-device", UUID[:-1] + "z"), "cuda-device must be a device number"),
    ]
    for args, want in cases:
        # --backend host: refused before any backend is looked at.
        p = kvstashd("--backend", "host", *args, "--socket", "/nonexistent/kvstashd.sock")
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert want in p.stderr and args[1] in p.stderr, (args, p.stderr)
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write("[kvstashd]\nbackend = host\ncuda_ipc = fabric\n")
    try:
        p = kvstashd("--config", f.name)
        assert p.returncode == 2 and f"{f.name}:3:" in p.stderr, p.stderr
        assert "cuda-ipc must be auto" in p.stderr, p.stderr
    finally:
        os.unlink(f.name)


def check_print_config_round_trip(ctx):
    p = kvstashd("--cuda-ipc", "legacy", "--cuda-device", UUID, "--print-config")
    assert p.returncode == 0, p.stderr
    assert "cuda_ipc = legacy\n" in p.stdout and f"cuda_device = {UUID}\n" in p.stdout, p.stdout
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write(p.stdout)
    try:
        q = kvstashd("--config", f.name, "--print-config")
        assert q.returncode == 0, q.stderr
        assert q.stdout.splitlines()[1:] == p.stdout.splitlines()[1:], (p.stdout, q.stdout)
    finally:
        os.unlink(f.name)


def check_host_backend_ignores_cuda_keys(ctx):
    """ctx.daemon runs --backend host with both cuda keys set."""
    w = WorkerProc(ctx.daemon, "host", seed=11, tokens=64, step=7)
    r = w.finish()
    assert r["tokens"] == 64 and r["checked"] > 0, r
    assert ctx.daemon.stats().backend == ctx.daemon.backend == "host", ctx.daemon.backend


if __name__ == "__main__":
    sys.exit(run_tests("test_backend_cuda", [
        check_backend_cuda_at_start,
        check_bad_values_refused,
        check_print_config_round_trip,
        check_host_backend_ignores_cuda_keys,
        check_worker_on_gpu_pool,
    ], daemon_kwargs={"backend": "host",
                      "extra_args": ("--cuda-ipc", "vmm", "--cuda-device", UUID)}))
