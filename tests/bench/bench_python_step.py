#!/usr/bin/env python3
"""bench_python_step.py - what the Python binding adds to a decode step
(issue 13, "Cost"), against the same step from C and a raw Unix-socket round
trip, all in one run.

One decode step of a "full" sequence, as bench_rpc times it: append 1 token,
report the step (no statistics: full needs none), check the epoch.

  binding step  through the kvstash package: seq.append(1), seq.step(new_tokens=1),
                seq.epoch() (a Table object per append, exceptions on errors)
  ctypes step   the same three libkvstash calls made straight from Python
                through ctypes with preallocated structs: the floor any
                Python binding of libkvstash pays
  C step        bench_rpc's "ring step" row (build/tests/bench/bench_rpc
                [--quick]: a C worker, its own kvstashd, as many steps), run
                once per round
  raw UDS       64-byte ping-pong through a socketpair with a forked echo
                child: in Python here, and bench_rpc's C figure

Each round runs bench_rpc, then the binding and ctypes steps alternating
on one fresh sequence (N/2 of each after warm-up; the sequence ends as long
as bench_rpc's: a step's cost grows with it). The report is the median over
rounds of each round's p50, and the ratios of those medians. The goal
(issue 13): binding step <= 2x the C step. Exits non-zero when a part cannot
run, never because of a ratio.

Usage: bench_python_step.py [--quick] [--rounds R] [--pin CPU] [--build DIR]
--pin puts this process, its echo child, its kvstashd and bench_rpc (which
pins itself and its own daemon) on one CPU, as bench_rpc --pin does.
(Debian's /usr/bin/python3, with numpy; the package from client/python.)
"""
import argparse
import ctypes
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

MSG_BYTES = 64
# bench_rpc's geometry (tests/bench/bench_rpc.c, bench_geom) and pool size.
GEOMETRY = dict(layers=4, q_heads=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="fp16")
POOL_MB = 192


def p50_us(samples_ns):
    return statistics.median(samples_ns) / 1000.0


def raw_uds(n):
    """p50 of n 64-byte round trips with a forked echo child (forked before
    libkvstash and its threads are loaded in this process)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the echo child
        a.close()
        try:
            while True:
                msg = b.recv(MSG_BYTES, socket.MSG_WAITALL)
                if not msg:
                    break
                b.sendall(msg)
        finally:
            os._exit(0)
    b.close()
    msg = b"x" * MSG_BYTES
    times = []
    for i in range(n + n // 10):
        t0 = time.perf_counter_ns()
        a.sendall(msg)
        got = a.recv(MSG_BYTES, socket.MSG_WAITALL)
        t1 = time.perf_counter_ns()
        assert got == msg, "echo child answered wrongly"
        if i >= n // 10:
            times.append(t1 - t0)
    a.close()
    os.waitpid(pid, 0)
    return p50_us(times)


def python_steps(session, n):
    """p50s of decode steps through the package's API and through bare
    ctypes, alternating on one fresh sequence (so both see the same sequence
    lengths and the same machine): (n + n/10) / 2 steps of each, the first
    tenth warm-up; the sequence ends as long as bench_rpc's."""
    from kvstash import _lib
    lib, h = session._lib, session.handle()
    table, step = _lib.Table_(), _lib.Step_(new_tokens=1, confidence=-1.0)
    epoch = ctypes.c_uint64()
    p_table, p_step, p_epoch = ctypes.byref(table), ctypes.byref(step), ctypes.byref(epoch)
    append, free, report, check = (lib.kvs_seq_append, lib.kvs_table_free, lib.kvs_seq_step,
                                   lib.kvs_seq_epoch)
    binding, bare = [], []
    pairs, warm = (n + n // 10) // 2, n // 20
    with session.create_sequence("full", label="bench-python") as seq:
        sid = seq.id
        for i in range(pairs):
            for kind in ((0, 1) if i % 2 else (1, 0)):
                if kind == 0:  # the package
                    t0 = time.perf_counter_ns()
                    seq.append(1)
                    seq.step(new_tokens=1)
                    seq.epoch()
                    t1 = time.perf_counter_ns()
                    if i >= warm:
                        binding.append(t1 - t0)
                else:  # bare ctypes
                    t0 = time.perf_counter_ns()
                    rc = append(h, sid, 1, p_table)
                    free(p_table)
                    rc = rc or report(h, sid, p_step, None) or check(h, sid, p_epoch)
                    t1 = time.perf_counter_ns()
                    if rc:
                        session.raise_for(rc)
                    if i >= warm:
                        bare.append(t1 - t0)
    return p50_us(binding), p50_us(bare)


def bench_rpc(build, daemon, quick, pin):
    """bench_rpc's p50s of the raw UDS ping-pong and the ring step (µs). Its
    ring step runs 2000 steps (500 with --quick), as many as ours."""
    cmd = [os.path.join(build, "tests", "bench", "bench_rpc"), *(["--quick"] if quick else []),
           *(["--pin", str(pin)] if pin is not None else []), daemon]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"bench_rpc failed ({out.returncode}): {out.stderr.strip()}")
    rows = {}
    for label, key in (("raw UDS ping-pong (64 B)", "raw"),
                       ("ring step (append + step + epoch)", "step")):
        m = re.search(re.escape(label) + r"\s+\d+\s+([\d.]+)", out.stdout)
        if not m:
            raise RuntimeError(f"bench_rpc printed no {label!r} row:\n{out.stdout}")
        rows[key] = float(m.group(1))
    return rows


class Daemon:
    """kvstashd on a fresh temporary socket, as bench_rpc starts it."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="bench-python.")
        self.sock = os.path.join(self.dir, "kvstashd.sock")
        self.proc = subprocess.Popen([binary, "--socket", self.sock, "--pool-mb", str(POOL_MB),
                                      "--log-level", "warn"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        import kvstash
        while True:
            try:
                kvstash.stats(self.sock)
                return
            except kvstash.KvstashError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvstashd did not start on {self.sock}") from None
                time.sleep(0.05)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        if rc != 0:
            raise RuntimeError(f"kvstashd exited with status {rc}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 500 steps, 3 rounds")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, 3 with --quick)")
    ap.add_argument("--pin", type=int, metavar="CPU", help="run everything on this CPU")
    ap.add_argument("--build", default=os.environ.get("BUILD_DIR", os.path.join(REPO, "build")),
                    help="the build tree (default $BUILD_DIR or build)")
    args = ap.parse_args()
    n_steps, n_raw = (500, 5000) if args.quick else (2000, 20000)
    rounds = args.rounds or (3 if args.quick else 5)
    daemon_bin = os.path.join(args.build, "daemon", "kvstashd")
    os.environ.setdefault("KVSTASH_LIB", os.path.join(args.build, "client", "libkvstash.so"))

    if args.pin is not None:  # inherited by the echo child and the daemon
        os.sched_setaffinity(0, {args.pin})
    # The Python ping-pong's echo child is forked before libkvstash is loaded.
    py_raw = [raw_uds(n_raw) for _ in range(rounds)]
    import kvstash
    d = Daemon(daemon_bin)
    rows = {"py_raw": py_raw, "c_raw": [], "c_step": [], "ctypes": [], "binding": []}
    try:
        with kvstash.Session.attach("bench", kvstash.Geometry(**GEOMETRY), socket=d.sock,
                                    worker_name="bench_python_step") as s:
            for r in range(rounds):
                c = bench_rpc(args.build, daemon_bin, args.quick, args.pin)
                rows["c_raw"].append(c["raw"])
                rows["c_step"].append(c["step"])
                binding, bare = python_steps(s, n_steps)
                rows["binding"].append(binding)
                rows["ctypes"].append(bare)
                print(f"round {r + 1}/{rounds}: binding {rows['binding'][-1]:.1f} us, ctypes "
                      f"{rows['ctypes'][-1]:.1f} us, C {c['step']:.1f} us", flush=True)
    finally:
        d.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    pinned = f"pinned to CPU {args.pin}" if args.pin is not None else "not pinned"
    print(f"\nbench_python_step: {'quick' if args.quick else 'full'} run, {pinned}, {rounds} "
          f"rounds, N = {n_steps} steps ({n_raw} raw round trips); median of the rounds' p50s")
    print(f"{'per step / round trip':44} {'p50 us':>8}   rounds")
    for key, label in (("py_raw", "raw UDS ping-pong, Python (64 B)"),
                       ("c_raw", "raw UDS ping-pong, C (bench_rpc)"),
                       ("c_step", "C step (bench_rpc ring step)"),
                       ("ctypes", "ctypes step (bare libkvstash calls)"),
                       ("binding", "binding step (kvstash package)")):
        print(f"{label:44} {med[key]:8.1f}   " + " ".join(f"{x:.1f}" for x in rows[key]))
    print(f"\nratios: binding/C_step {med['binding'] / med['c_step']:.2f} (goal <= 2), "
          f"ctypes/C_step {med['ctypes'] / med['c_step']:.2f}, "
          f"binding/ctypes {med['binding'] / med['ctypes']:.2f}, "
          f"binding/raw_uds_C {med['binding'] / med['c_raw']:.2f}, "
          f"binding/raw_uds_py {med['binding'] / med['py_raw']:.2f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, OSError) as e:
        print(f"bench_python_step: {e}", file=sys.stderr)
        sys.exit(1)
