"""test_shadow.py - the shadow backend makes direct pool access fault.

kvstashd --backend shadow keeps pools in host memory but hands the daemon's
own code and every worker only a PROT_NONE "device" address; the memory
operations (kernels/ops.h, kv_ops_shadow) translate it. So:
  - a real worker that goes through libkvstash's ops writes, reads back and
    verifies every token, with tiers (INT8, sketch) on, from host buffers
    and from device buffers (kvs_layer_write_dev / kvs_layer_read_dev, which
    must copy device to device: a host-side copy of a shadow buffer faults);
  - the same worker reading the pool by pointer (--poke) dies of SIGSEGV,
    while on the host backend the same read works;
  - the daemon's mapping of the pool sits behind a PROT_NONE range of the
    pool's size in its /proc maps (the daemon itself holds no readable view
    other than the one the ops use).
The whole integration suite also runs on this backend (ctest
integration-shadow/*); this file checks that the backend really faults.
"""
import os
import signal
import subprocess
import sys

from kvstash_harness import Daemon, run_tests
from worker_procs import GEOMETRY, WorkerProc


def poke(daemon):
    binary = os.environ["KVSTASH_TEST_WORKER"]
    return subprocess.run([binary, "--socket", daemon.sock, "--model", "poke", *GEOMETRY,
                           "--tokens", "4", "--poke"], capture_output=True, text=True,
                          timeout=60)


def check_worker_through_ops(ctx):
    w = WorkerProc(ctx.daemon, "ops", seed=3, tokens=96, step=5, policy="streaming",
                   params=("n_sink=4", "window=24", "int8=on", "int8_window=8",
                           "victims=sketch"))
    r = w.finish()
    assert r["tokens"] == 96 and r["checked"] > 0, r


def check_worker_through_device_buffers(ctx):
    w = WorkerProc(ctx.daemon, "dev", seed=4, tokens=96, step=5, policy="streaming",
                   params=("n_sink=4", "window=24", "int8=on", "int8_window=8",
                           "victims=sketch"), dev_io=True)
    r = w.finish()
    assert r["tokens"] == 96 and r["checked"] > 0, r


def faulted(p):
    """Whether the worker died of a segmentation fault (AddressSanitizer and
    ThreadSanitizer report it and exit 1 rather than die of the signal)."""
    if p.returncode == -signal.SIGSEGV:
        return True
    return os.environ.get("KVSTASH_SANITIZE") == "1" and p.returncode != 0 and \
        "SEGV" in p.stderr


def check_poke_faults(ctx):
    p = poke(ctx.daemon)
    assert faulted(p), (p.returncode, p.stdout, p.stderr)
    assert "ATTACHED" in p.stdout and "POKED" not in p.stdout, p.stdout


def check_daemon_holds_a_shadow(ctx):
    w = WorkerProc(ctx.daemon, "held", seed=5, tokens=16, hold=True)
    w.wait_line("READY")
    (pool,) = ctx.daemon.stats().pools
    page = os.sysconf("SC_PAGE_SIZE")
    want = (pool.bytes_total + page - 1) // page * page
    sizes = []
    with open(f"/proc/{ctx.daemon.proc.pid}/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if fields[1] == "---p":
                sizes.append(hi - lo)
    w.finish()
    assert pool.bytes_total > 0 and want in sizes, \
        f"no PROT_NONE range of {want} bytes in kvstashd's maps: {sizes}"


def check_poke_works_on_host(ctx):
    d = Daemon(backend="host")
    d.start()
    try:
        p = poke(d)
        assert p.returncode == 0 and "POKED" in p.stdout, (p.returncode, p.stdout, p.stderr)
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(run_tests("test_shadow", [
        check_worker_through_ops,
        check_worker_through_device_buffers,
        check_poke_faults,
        check_daemon_holds_a_shadow,
        check_poke_works_on_host,
    # --dumpable: the test reads kvstashd's /proc/<pid>/maps, which a
    # non-dumpable daemon (the default) hides from a test run as another user.
    ], daemon_kwargs={"backend": "shadow", "extra_args": ("--dumpable",)}))
