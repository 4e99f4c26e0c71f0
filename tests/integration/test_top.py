"""`kvstash top` on a real terminal, under tmux (issue 6, acceptance 3).

Real workers hold sequences in a real kvstashd; `kvstash top` runs in a
detached tmux session (a real pseudo-terminal: alternate screen, raw keys).
The test captures the pane and finds every worker (name, pid) and every
sequence (id, policy, label) in it, sees a worker that attaches later appear
(the view refreshes), and quits with `q`. It also runs `kvstash replay` on a
trace file in a pane, where the progress line must reach 100%.

tmux runs on its own server socket (-L), killed at the end.
"""
import json
import os
import shutil
import subprocess
import sys
import time

from kvstash_harness import run_tests
from worker_procs import WorkerProc

CLI = os.environ.get("KVSTASH_CLI", "")
SERVER = f"kvstash-test-{os.getpid()}"


def tmux(*args, check=True):
    p = subprocess.run(["tmux", "-L", SERVER, *args], capture_output=True, text=True,
                       timeout=30)
    if check:
        assert p.returncode == 0, f"tmux {' '.join(args)}: {p.returncode} {p.stderr}"
    return p


def pane(target):
    return tmux("capture-pane", "-p", "-t", target).stdout


def wait_pane(target, want, timeout=15.0):
    """Capture until every string of `want` is in the pane; return the pane."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = pane(target)
        if all(w in text for w in want):
            return text
        time.sleep(0.1)
    missing = [w for w in want if w not in text]
    raise AssertionError(f"not in the pane after {timeout} s: {missing}\n--- pane ---\n{text}")


def line_with(text, *needles):
    for line in text.splitlines():
        if all(n in line.split() for n in needles):
            return line
    raise AssertionError(f"no line with {needles} in the pane\n{text}")


def check_tmux_is_there(ctx):
    assert shutil.which("tmux"), "tmux is not installed (ops/setup.sh installs it)"
    ctx.workers = []


def check_top_shows_the_workers_sequences(ctx):
    a = WorkerProc(ctx.daemon, "top-alpha", seed=1, tokens=48, step=8, sequences=2, hold=True)
    b = WorkerProc(ctx.daemon, "top-beta", seed=2, tokens=30, step=5, policy="streaming",
                   params=("n_sink=2", "window=8"), hold=True)
    ctx.workers += [a, b]
    for w in (a, b):
        w.wait_line("READY")
    st = ctx.daemon.stats()
    cmd = f"{CLI} --socket {ctx.daemon.sock} top --interval 0.2"
    tmux("new-session", "-d", "-s", "top", "-x", "180", "-y", "50", cmd)
    ids = [str(q.seq_id) for q in st.sequences]
    text = wait_pane("top", ["kvstash top", "WORKERS", "SEQUENCES", "top-alpha", "top-beta",
                             *ids])
    for w in (a, b):
        line = line_with(text, w.name)
        assert str(w.proc.pid) in line.split() and str(w.session_id()) in line.split(), line
    for q in st.sequences:
        line = line_with(text, str(q.seq_id), q.policy)
        assert str(q.appended) in line.split() and str(q.tokens) in line.split(), \
            (line, q.appended, q.tokens)
    assert "serving" in text and 'pool 1 "itest"' in text, text
    # A worker that attaches now shows up: the view refreshes.
    c = WorkerProc(ctx.daemon, "top-gamma", seed=3, tokens=16, hold=True)
    ctx.workers.append(c)
    c.wait_line("READY")
    wait_pane("top", ["top-gamma", "workers 3"])
    # q quits: the pane's command ends, and with it the tmux session.
    tmux("send-keys", "-t", "top", "q")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and tmux("has-session", "-t", "top",
                                               check=False).returncode == 0:
        time.sleep(0.1)
    assert tmux("has-session", "-t", "top", check=False).returncode != 0, \
        "kvstash top did not quit on q"


def check_top_exits_3_without_a_daemon(ctx):
    missing = os.path.join(ctx.daemon.dir, "none.sock")
    out = os.path.join(ctx.daemon.dir, "top-none.txt")
    tmux("new-session", "-d", "-s", "none", "-x", "120", "-y", "20",
         f"sh -c '{CLI} --socket {missing} top; echo EXIT=$? > {out}; sleep 60'")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not os.path.exists(out):
        time.sleep(0.1)
    with open(out) as f:
        assert f.read().strip() == "EXIT=3"
    assert "kvstashd is not running" in pane("none")
    tmux("kill-session", "-t", "none")


def check_replay_progress_on_a_terminal(ctx):
    trace = os.path.join(ctx.daemon.dir, "long.jsonl")
    with open(trace, "w") as f:
        for i in range(5000):
            f.write(json.dumps({"step": {"new_tokens": 1}}) + "\n")
    out = os.path.join(ctx.daemon.dir, "replay.out")
    done = os.path.join(ctx.daemon.dir, "replay.rc")
    tmux("new-session", "-d", "-s", "replay", "-x", "120", "-y", "20",
         f"sh -c '{CLI} replay --policy streaming --set window=16 < {trace} > {out}; "
         f"echo EXIT=$? > {done}; sleep 60'")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.exists(done):
        time.sleep(0.1)
    with open(done) as f:
        assert f.read().strip() == "EXIT=0"
    wait_pane("replay", ["kvstash replay: read", "(100%), done"])
    with open(out) as f:
        assert sum(1 for _ in f) == 5000, "replay did not answer every step"
    tmux("kill-session", "-t", "replay")
    # Not on a terminal: no progress line at all.
    with open(trace) as f:
        p = subprocess.run([CLI, "replay", "--policy", "streaming"], stdin=f, capture_output=True,
                           text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr[:200]


def check_workers_finish(ctx):
    for w in ctx.workers:
        w.finish()
    ctx.workers = []


def run():
    try:
        return run_tests("top", [check_tmux_is_there, check_top_shows_the_workers_sequences,
                                 check_top_exits_3_without_a_daemon,
                                 check_replay_progress_on_a_terminal, check_workers_finish])
    finally:
        subprocess.run(["tmux", "-L", SERVER, "kill-server"], capture_output=True, timeout=30)


if __name__ == "__main__":
    sys.exit(run())
