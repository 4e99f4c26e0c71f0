"""The daemon under valgrind memcheck: workers attach, write, step every
kind of policy through the ring, get killed, detach; the daemon must report
no memory error and no definite leak, and exit cleanly. (The ASan build has
its own sanitizers and skips this; valgrind cannot run ASan binaries.)"""
import os
import shutil
import signal
import sys

from kvstash_harness import run_tests
from worker_procs import WorkerProc
from test_policies_e2e import run_worker

VALGRIND = ["valgrind", "--error-exitcode=99", "--leak-check=full",
            "--errors-for-leak-kinds=definite", "--show-leak-kinds=definite",
            "--track-fds=no", "--quiet"]


def check_workers_and_policies(ctx):
    for policy, params, arrays, flags in (
            ("streaming", ["window=8"], "", []),
            ("h2o", ["budget=16"], "score", []),
            ("adakv", ["budget=16", "window=4", "kernel=3"], "window", []),
            ("weightedkv", ["cache_size=16", "n_init=2", "n_recent=4"], "last",
             ["--no-verify-values"])):
        run_worker(ctx, policy, params, arrays, flags,
                   os.path.join(ctx.daemon.dir, policy + ".jsonl"))


def check_a_killed_worker(ctx):
    victim = WorkerProc(ctx.daemon, "victim", seed=5, tokens=100000, step=8, sleep_ms=1)
    victim.wait_line("APPENDED 64", timeout=60)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    survivor = WorkerProc(ctx.daemon, "survivor", seed=6, tokens=64, step=4)
    survivor.finish(timeout=120)


if __name__ == "__main__":
    if os.environ.get("KVSTASH_SANITIZE", "0") not in ("0", ""):
        print("valgrind: skipped in the sanitizer build")
        print("0 passed, 0 failed, 1 skipped")
        sys.exit(0)
    if shutil.which("valgrind") is None:
        print("valgrind: not installed (ops/setup.sh installs it)")
        print("0 passed, 1 failed")
        sys.exit(1)
    sys.exit(run_tests("valgrind", [check_workers_and_policies, check_a_killed_worker],
                       daemon_kwargs={"pool_mb": 16, "wrapper": VALGRIND, "log_level": "info"}))
