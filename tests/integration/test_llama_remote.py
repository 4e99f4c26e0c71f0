"""A real model's sequence moving between daemons (issue 17; docs/remote.md
"Export and import"): the importing daemon's worker continues decoding and
gets the same next-token log-likelihoods as if nothing had moved.

A 3-master Redis Cluster (tests/remote/cluster.py, no replicas) and two
kvstashd on it (same --remote-namespace), A and B. kvstash-llama scores
story 0 of ../shared/data/tinystories_val_dev.txt (171 tokens) with
stories260K:

* for `full`, `streaming`, `tova`, `h2o`, `ov_block`, `confkv` and
  `weightedkv` (budget 32: they evict long before the cut), and `streaming`
  and `full` demoting to INT8 / INT4: an uninterrupted run on A; then
  `score --export-at K` on A (steps 0..K-1, per-token lines 1..K) and
  `score --import-file` on B (steps K..169, lines K+1..170). The two runs'
  lines, concatenated, are the uninterrupted run's, bit for bit (%.17g): the
  blocks of every tier and the policy's own state (h2o's scores, confkv's
  EMA, weightedkv's accumulators, ov_block's scores and RNG) moved exactly;
* `reviver` likewise: its tokens in the count-sketch (the Vague store) move
  as the sketch's cells (format 2), and the importing daemon's swap-backs
  revive the same estimates;
* `snapkv`, `adakv`, `criticalkv` and `criticalkv_ada` (budget 32, window
  8), and `snapkv` after a 40-token prompt: their steps carry the worker's
  statistics of earlier tokens (the observation window's queries; criticalkv's
  value norms), which kvstash-llama moves itself, in PATH.worker beside the
  export file (client/llama/cache.c "worker state"), next to the daemon's
  compression records. They evict before the cut and after it;
* two hops (tova, and criticalkv_ada: worker state read and written again in
  one run): A to B at 50, B back to A at 120 (import and export in one run),
  the same lines again;
* refusals: a uid never exported, a file whose K is not the export's, a
  policy that is not the export's; a worker state that is missing, corrupted,
  truncated, of another export or of another window (nothing imported); and
  the options that cannot work (exit 2).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from kvstash_harness import Daemon, run_tests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "remote"))
import cluster  # noqa: E402  tests/remote/cluster.py

BUILD = os.environ.get("KVSTASH_BUILD_DIR", "")
LLAMA = os.path.join(BUILD, "client", "llama", "kvstash-llama")
DATA = os.path.join(os.environ.get("KVSTASH_SHARED_DIR", ""), "data")
MODEL = os.path.join(DATA, "stories260K.bin")
TEXT = os.path.join(DATA, "tinystories_val_dev.txt")
CLUSTER_DIR = tempfile.mkdtemp(prefix="kvstash-redis.")
NAMESPACE = f"t{os.getpid()}"
PORTS = []
KEEPS_ALL = ("full", "reviver")  # never evict: reviver sketches instead (its Vague store)
# Steps carry the worker's own statistics of earlier tokens: PATH.worker moves them.
WORKER_STATE = ("snapkv", "adakv", "criticalkv", "criticalkv_ada")
STORY_TOKENS = 171  # story 0: BOS and 170 tokens, 170 scored
BUDGET = "32"
CASES = [  # name, policy, its options, K
    ("full", "full", [], 60),
    ("streaming", "streaming", ["--budget", BUDGET], 80),
    ("tova", "tova", ["--budget", BUDGET], 80),
    # Quantised tiers move as their own bytes: INT8 and INT4 blocks, with
    # tokens still waiting at full precision for a whole block's worth.
    ("streaming-int8", "streaming", ["--budget", "64", "--demote", "int8"], 90),
    ("full-int4", "full", ["--demote", "int4"], 70),
    # Policies with state of their own carry it (policy_ops.export_layer).
    ("h2o", "h2o", ["--budget", BUDGET], 80),
    ("ov_block", "ov_block", ["--budget", BUDGET], 90),
    ("confkv", "confkv", ["--budget", BUDGET], 80),      # INT8 tiers, its EMA
    ("weightedkv", "weightedkv", ["--budget", BUDGET], 80),  # per-head lists, merged values
    ("reviver", "reviver", ["--budget", BUDGET], 80),  # tokens in its count-sketch
    # The worker's observation window (and value norms) move in PATH.worker.
    ("snapkv", "snapkv", ["--budget", BUDGET], 80),
    ("adakv", "adakv", ["--budget", BUDGET], 80),  # per-head lists
    ("criticalkv", "criticalkv", ["--budget", BUDGET], 80),  # and value norms
    ("criticalkv_ada", "criticalkv_ada", ["--budget", BUDGET], 80),
    # A prompt's queries fill the window without steps (deferred), then the
    # prefill step compresses.
    ("snapkv-prompt", "snapkv", ["--budget", BUDGET, "--prompt-tokens", "40"], 80),
]


def remote_args():
    seeds = ",".join(f"127.0.0.1:{p}" for p in PORTS[:2])
    return ["--remote", seeds, "--remote-namespace", NAMESPACE]


def llama(daemon, *args, timeout=60):
    """kvstash-llama score of story 0 on `daemon` (a Daemon, or None: no
    --socket); the CompletedProcess."""
    cmd = [LLAMA, "score", "--model", MODEL, "--text", TEXT, "--stories", "1", "--batch", "1",
           *(["--socket", daemon.sock] if daemon else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def ok(daemon, *args):
    """Run, assert exit 0; the JSON summary."""
    p = llama(daemon, *args)
    assert p.returncode == 0, f"kvstash-llama {' '.join(args)}: exit {p.returncode}\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def fails(daemon, code, needles, *args):
    """Run, assert exit `code` and a stderr naming every needle; the stderr."""
    p = llama(daemon, *args)
    assert p.returncode == code and all(n in p.stderr for n in needles), \
        f"kvstash-llama {' '.join(args)}: exit {p.returncode} (want {code}), " \
        f"stderr {p.stderr!r} (want {needles})"
    return p.stderr


def lines(path):
    with open(path) as f:
        return f.read().splitlines()


def positions(ls):
    return [int(l.split()[1]) for l in ls]


def export_file(path):
    with open(path) as f:
        uid, k = f.read().split()
    assert len(uid) == 32 and all(c in "0123456789abcdef" for c in uid), uid
    return uid, int(k)


# ---- checks ------------------------------------------------------------------


def check_setup(ctx):
    assert os.access(LLAMA, os.X_OK), f"{LLAMA} is not built (the kvstash-llama target)"
    ctx.tmp = tempfile.mkdtemp(prefix="kvstash-llama-remote.")
    ctx.exports = {}
    ctx.b = Daemon(pool_mb=16, extra_args=remote_args()).start()


def check_moved_story_scores_as_uninterrupted(ctx):
    for name, policy, opts, k in CASES:
        base = os.path.join(ctx.tmp, name)
        args = ["--policy", policy, *opts]
        whole = ok(ctx.daemon, *args, "--per-token", base + ".0")
        ref = lines(base + ".0")
        assert positions(ref) == list(range(1, STORY_TOKENS)), (policy, len(ref))
        assert (whole["evicted"] > 0) == (policy not in KEEPS_ALL), (policy, whole)
        a = ok(ctx.daemon, *args, "--per-token", base + ".a", "--export-at", str(k),
               "--export-file", base + ".x")
        uid, got_k = export_file(base + ".x")
        assert got_k == k, (policy, got_k, k)
        assert os.path.exists(base + ".x.worker") == (policy in WORKER_STATE), policy
        if "--demote" in opts:  # quantised tokens were read before the export
            i = opts.index("--demote")
            plain = ok(ctx.daemon, "--policy", policy, *opts[:i], *opts[i + 2:], "--export-at",
                       str(k), "--export-file", base + ".plain")
            assert a["nll"] != plain["nll"], (name, a, plain)
        # Evictions happened before the export: it carries a cut-down cache.
        assert a["tokens"] == k and (a["evicted"] > 0) == (policy not in KEEPS_ALL), (policy, a)
        if policy == "reviver":  # it had sketched: the export carries sketch values
            sketches = [key for p in cluster.masters(CLUSTER_DIR)
                        for key in cluster.call(p, "KEYS", f"kvs:{NAMESPACE}:*{uid}}}:*.sketch")]
            assert sketches, (policy, uid)
        b = ok(ctx.b, *args, "--per-token", base + ".b", "--import-file", base + ".x")
        assert b["tokens"] == STORY_TOKENS - 1 - k, (policy, b)
        # ... and after the import: the moved state is used, not just carried.
        assert (b["evicted"] > 0) == (policy not in KEEPS_ALL), (policy, b)
        got_a, got_b = lines(base + ".a"), lines(base + ".b")
        assert positions(got_a) == list(range(1, k + 1)), policy
        assert positions(got_b) == list(range(k + 1, STORY_TOKENS)), policy
        diff = [(x, y) for x, y in zip(ref, got_a + got_b) if x != y]
        assert not diff, f"{policy}: {len(diff)} lines differ, first {diff[0]} (uid {uid})"
        total = a["nll"] * a["tokens"] + b["nll"] * b["tokens"]  # nll is a mean
        assert abs(total - whole["nll"] * whole["tokens"]) < 1e-9, (policy, a, b, whole)
        ctx.exports[name] = base + ".x"


def check_two_hops(ctx):
    """A to B at 50, B (import and export in one run) back to A at 120."""
    for policy in ("tova", "criticalkv_ada"):
        base = os.path.join(ctx.tmp, "hops-" + policy)
        args = ["--policy", policy, "--budget", BUDGET]
        ref = lines(os.path.join(ctx.tmp, policy + ".0"))
        ok(ctx.daemon, *args, "--per-token", base + ".1", "--export-at", "50",
           "--export-file", base + ".x1")
        ok(ctx.b, *args, "--per-token", base + ".2", "--import-file", base + ".x1",
           "--export-at", "120", "--export-file", base + ".x2")
        assert export_file(base + ".x2")[1] == 120
        ok(ctx.daemon, *args, "--per-token", base + ".3", "--import-file", base + ".x2")
        got = lines(base + ".1") + lines(base + ".2") + lines(base + ".3")
        assert positions(got) == list(range(1, STORY_TOKENS)), (policy, positions(got))
        diff = [(x, y) for x, y in zip(ref, got) if x != y]
        assert not diff, f"{policy}: {len(diff)} lines differ, first {diff[0]}"


def check_worker_state_refusals(ctx):
    """A SnapKV-family import without its worker state, or with one that is
    not its own, fails (exit 1, the file named and why) before importing."""
    src = ctx.exports["snapkv"]
    args = ["--policy", "snapkv", "--budget", BUDGET]
    with open(src + ".worker", "rb") as f:
        good = f.read()
    x = os.path.join(ctx.tmp, "ws.x")
    shutil.copy(src, x)  # the export file, without its .worker
    fails(ctx.b, 1, [f"worker state {x}.worker", "No such file", "policy snapkv"], *args,
          "--import-file", x)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01  # a bit of the window's history
    cases = [(bytes(flipped), ["checksum mismatch", "corrupted"]),
             (good[:-100], ["checksum mismatch", "truncated"]),
             (b"not a worker state file", ["not a kvstash-llama worker state file"])]
    with open(ctx.exports["criticalkv"] + ".worker", "rb") as f:
        other = f.read()  # an intact file, of another export and policy
    cases.append((other, ["written for export"]))
    for data, needles in cases:
        with open(x + ".worker", "wb") as f:
            f.write(data)
        fails(ctx.b, 1, [f"worker state {x}.worker", *needles], *args, "--import-file", x)
    # The right file for another window (the statistics' shape differs).
    with open(x + ".worker", "wb") as f:
        f.write(good)
    fails(ctx.b, 1, ["observation window of 8 queries, not 4"], *args, "--set", "window=4",
          "--import-file", x)
    assert not ctx.b.stats().sequences, "an import refused for its worker state left a sequence"
    # The export itself is untouched: with its own file it imports as before.
    ok(ctx.b, *args, "--per-token", x + ".b", "--import-file", x)
    assert lines(x + ".b") == lines(os.path.join(ctx.tmp, "snapkv.b"))


def check_refusals(ctx):
    x = os.path.join(ctx.tmp, "refused.x")
    bad = os.path.join(ctx.tmp, "unknown.x")
    uid = "0123456789abcdef0123456789abcdef"
    with open(bad, "w") as f:
        f.write(f"{uid} 80\n")
    fails(ctx.b, 1, ["ImportSequence", uid], "--import-file", bad)
    # A real export, but the file's K is not its own.
    src = ctx.exports["streaming"]
    uid, k = export_file(src)
    with open(bad, "w") as f:
        f.write(f"{uid} {k + 1}\n")
    fails(ctx.b, 1, [f"{k} tokens appended", f"K = {k + 1}"], "--policy", "streaming",
          "--budget", BUDGET, "--import-file", bad)
    # The right export under another policy: the steps would carry the wrong
    # statistics.
    fails(ctx.b, 1, ["runs policy streaming, not tova"], "--policy", "tova", "--budget", BUDGET,
          "--import-file", src)
    with open(bad, "w") as f:
        f.write("not an export\n")
    fails(ctx.b, 2, ["--import-file", "UID K"], "--import-file", bad)
    # What cannot work: usage errors (exit 2).
    exp = ["--export-file", x]
    for args, needle in [(["--export-at", "0", *exp], "at least 1"),
                         (["--export-at", "170", *exp], "K must be in 1..169"),
                         (["--export-at", "40", *exp, "--batch", "2"], "--batch 1"),
                         (["--export-at", "40"], "go together"),
                         (["--export-at", "40", *exp, "--prompt-tokens", "50"],
                          "K must be in 50..169"),
                         (["--import-file", src, "--export-at", str(k), *exp],
                          f"K must be in {k + 1}..169")]:
        fails(ctx.daemon, 2, [needle], *args)
    fails(None, 2, ["not with --no-daemon"], "--no-daemon", "--export-at", "40", *exp)
    p = subprocess.run([LLAMA, "generate", "--export-at", "4", *exp], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2 and "options of score" in p.stderr, (p.returncode, p.stderr)
    p = subprocess.run([LLAMA, "score", "--model", MODEL, "--text", TEXT, "--stories", "2",
                        "--socket", ctx.daemon.sock, "--export-at", "4", *exp],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--stories 1" in p.stderr, (p.returncode, p.stderr)
    assert not os.path.exists(x)


def check_nothing_left_open(ctx):
    for d in (ctx.daemon, ctx.b):
        assert not d.stats().sequences, [s for s in d.stats().sequences]
    ctx.b.stop()
    ctx.b.cleanup()
    shutil.rmtree(ctx.tmp, ignore_errors=True)


def main():
    global PORTS
    try:
        PORTS = cluster.start(CLUSTER_DIR, masters_n=3, replicas_n=0, owner_pid=os.getpid())
    except Exception as e:  # noqa: BLE001 - a cluster that cannot start fails the test
        print(f"FAIL cluster start: {e} (ops/setup.sh installs redis-server)")
        print("test_llama_remote: 0 passed, 1 failed")
        cluster.stop(CLUSTER_DIR)
        return 1
    try:
        return run_tests("test_llama_remote", [
            check_setup,
            check_moved_story_scores_as_uninterrupted,
            check_two_hops,
            check_refusals,
            check_worker_state_refusals,
            check_nothing_left_open,
        ], daemon_kwargs={"pool_mb": 16, "extra_args": remote_args()})
    finally:
        cluster.stop(CLUSTER_DIR)
        shutil.rmtree(CLUSTER_DIR, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
