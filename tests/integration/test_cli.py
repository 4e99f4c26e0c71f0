"""The `kvstash` CLI against a real kvstashd with real workers (issue 6,
acceptance 1).

Real worker processes (kvs_test_worker, linked with libkvstash) attach, create
sequences under full, streaming and h2o, append, and hold. Every subcommand
runs with --json and its values are checked against what the workers did
(their pids, sessions, sequence ids, names, labels, tokens appended; for
streaming the positions its rule keeps, simulated here); the text output is
checked for the same facts. evict changes a sequence and the worker then
verifies every token it still holds; watch sees the events of a worker's
life and of an eviction. demote, offload and revive move a held sequence's
tokens between the full-precision ("full"), INT8 and sketch tiers: `seq show`
maps and the replies say where every position went, and the worker reads its
tables after each move (INT8 within the quantisation bound); an Evict with
to="fp16", the full tier's old name, revives as to="full" does. The error
cases exit non-zero with one line on stderr: daemon not running (3), unknown
sequence (4), permission denied (5), usage (2), and a daemon refusal (1).
`--help` works at every level.
"""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from kvstash_harness import Worker as HarnessWorker
from kvstash_harness import call, expect_status, fd_hello, pb, run_tests
from test_metrics import Scrape, metrics_port
from worker_procs import GEOMETRY, WorkerProc

CLI = os.environ.get("KVSTASH_CLI", "")
LAYERS, BLOCK_TOKENS = 3, 8  # worker_procs.GEOMETRY


class Worker(WorkerProc):
    """A kvs_test_worker holding its sequences (with a label) until finish()."""

    def __init__(self, daemon, name, seed, tokens, step=1, policy="full", params=(),
                 sequences=1, label=""):
        binary = os.environ["KVSTASH_TEST_WORKER"]
        args = [binary, "--socket", daemon.sock, "--model", "cli", *GEOMETRY, "--policy", policy,
                "--tokens", str(tokens), "--step", str(step), "--seed", str(seed),
                "--sequences", str(sequences), "--name", name, "--label", label, "--hold"]
        for p in params:
            args += ["--set", p]
        self.name, self.lines = name, []
        self.tokens, self.step, self.policy, self.params = tokens, step, policy, params
        self.label = label
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)

    def ready(self):
        self.wait_line("READY")
        return self


def run(ctx_or_sock, *args, timeout=60):
    sock = ctx_or_sock if isinstance(ctx_or_sock, str) else ctx_or_sock.daemon.sock
    p = subprocess.run([CLI, "--socket", sock, *args], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def ok_json(ctx, *args):
    rc, out, err = run(ctx, *args, "--json")
    assert rc == 0, f"kvstash {' '.join(args)} --json: exit {rc}: {err}"
    assert err == "", f"kvstash {' '.join(args)}: stderr {err!r}"
    return json.loads(out)


def ok_text(ctx, *args):
    rc, out, err = run(ctx, *args)
    assert rc == 0, f"kvstash {' '.join(args)}: exit {rc}: {err}"
    return out


def fails(ctx_or_sock, code, needle, *args, preexec=None):
    """Run and assert exit `code` with one line on stderr containing `needle`."""
    sock = ctx_or_sock if isinstance(ctx_or_sock, str) else ctx_or_sock.daemon.sock
    p = subprocess.run([CLI, "--socket", sock, *args], capture_output=True, text=True,
                       timeout=60, preexec_fn=preexec)
    lines = p.stderr.splitlines()
    assert p.returncode == code, (f"kvstash {' '.join(args)}: exit {p.returncode}, expected "
                                  f"{code}; stderr {p.stderr!r}")
    assert len(lines) == 1 and lines[0].startswith("kvstash") and needle in lines[0], \
        f"kvstash {' '.join(args)}: stderr {p.stderr!r} (want one line with {needle!r})"
    return lines[0]


def streaming_held(tokens, step, n_sink, window):
    """Positions a streaming sequence holds after appends of `step`: the rule
    runs at each append on the tokens appended before (seq.h)."""
    held, appended = [], 0
    while appended < tokens:
        if held and appended > 0:
            others = [p for p in held if p >= n_sink]
            drop = set(others[:max(0, len(others) - window)])
            held = [p for p in held if p not in drop]
        n = min(step, tokens - appended)
        held += range(appended, appended + n)
        appended += n
    return held


def runs_of(held, appended):
    """The position map `seq show` reports for a full-precision list."""
    runs, hs = [], set(held)
    for p in range(appended):
        tier = "full" if p in hs else "evicted"
        if runs and runs[-1]["tier"] == tier:
            runs[-1]["count"] += 1
        else:
            runs.append({"first_position": p, "count": 1, "tier": tier})
    return runs


def check_help_at_every_level(ctx):
    p = subprocess.run([CLI, "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("usage: kvstash"), p
    for cmd in ("status", "health", "workers", "seqs", "stats", "policy", "evict", "demote", "offload",
                "revive", "watch", "top", "replay"):
        assert re.search(rf"^  (\S+, )*{cmd}\b", p.stdout, re.M), f"--help does not list {cmd}"
    for args, head in ((["status"], "usage: kvstash status"),
                       (["health"], "usage: kvstash health"),
                       (["stats"], "usage: kvstash status"),
                       (["workers"], "usage: kvstash workers"),
                       (["seqs"], "usage: kvstash seqs"),
                       (["seq"], "usage: kvstash seq show"),
                       (["seq", "show"], "usage: kvstash seq show"),
                       (["policy"], "usage: kvstash policy list"),
                       (["policy", "list"], "usage: kvstash policy list"),
                       (["evict"], "usage: kvstash evict"),
                       (["demote"], "usage: kvstash demote"),
                       (["offload"], "usage: kvstash offload"),
                       (["revive"], "usage: kvstash revive"),
                       (["watch"], "usage: kvstash watch"),
                       (["top"], "usage: kvstash top"),
                       (["replay"], "usage: kvstash replay")):
        # --help needs no daemon: use a socket that does not exist.
        p = subprocess.run([CLI, "--socket", "/nonexistent/k.sock", *args, "--help"],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and p.stdout.startswith(head), \
            f"kvstash {' '.join(args)} --help: exit {p.returncode}, {p.stdout[:80]!r}"


def check_start_workers(ctx):
    ctx.full = Worker(ctx.daemon, "cli-full", seed=21, tokens=40, step=8, sequences=2,
                      label="req-full").ready()
    ctx.stream = Worker(ctx.daemon, "cli-stream", seed=22, tokens=60, step=6, policy="streaming",
                        params=("n_sink=2", "window=10"), label="req-stream").ready()
    # Operator evictions go to this one: streaming with a window that evicts nothing.
    ctx.victim = Worker(ctx.daemon, "cli-victim", seed=23, tokens=64, step=16,
                        policy="streaming", params=("n_sink=0", "window=100000"),
                        label="victim").ready()
    ctx.h2o = Worker(ctx.daemon, "cli-h2o", seed=24, tokens=16, step=16, policy="h2o",
                     label="no-evict").ready()
    ctx.workers = [ctx.full, ctx.stream, ctx.victim, ctx.h2o]
    for w in ctx.workers:
        w.session = w.session_id()
    st = ctx.daemon.stats()
    ctx.seq_of = {}
    for q in st.sequences:
        ctx.seq_of.setdefault(q.session_id, []).append(q.seq_id)
    for w in ctx.workers:
        w.seqs = sorted(ctx.seq_of[w.session])


def check_status(ctx):
    st = ok_json(ctx, "status")
    assert st["pid"] == ctx.daemon.proc.pid and st["serving"] is True
    assert st["backend"] == ctx.daemon.backend and st["version"]
    assert (st["device"], st["ipc"], st["lease_end"]) == ("none", "memfd", "free"), st
    assert len(st["sessions"]) == 4 and len(st["sequences"]) == 5
    (pool,) = st["pools"]
    assert pool["model"] == "cli" and pool["geometry"]["layers"] == LAYERS
    assert pool["blocks_used"] + pool["blocks_free"] + pool["blocks_retired"] + \
        pool["blocks_quarantined"] == pool["blocks_total"]
    full = [t for t in st["tiers"] if t["tier"] == "full"][0]
    assert full["tokens"] == sum(q["tokens"] for q in st["sequences"])
    assert set(ok_json(ctx, "stats")) == set(st)  # the same reply (uptime moves)
    out = ok_text(ctx, "status")
    assert f"(pid {ctx.daemon.proc.pid})" in out and "serving" in out, out
    assert 'pool 1 "cli": 3 layers' in out and "memory by tier:" in out, out
    assert "workers: 4, sequences: 5" in out, out
    rc, out, err = run(ctx, "health")
    assert (rc, out, err) == (0, "SERVING\n", ""), (rc, out, err)
    assert ok_json(ctx, "health") == {"status": "SERVING"}


def check_workers(ctx):
    got = {w["session_id"]: w for w in ok_json(ctx, "workers")["workers"]}
    assert set(got) == {w.session for w in ctx.workers}, got
    for w in ctx.workers:
        j = got[w.session]
        assert j["pid"] == w.proc.pid and j["uid"] == os.getuid(), j
        assert j["worker_name"] == w.name and j["lease_open"] is True, j
        assert j["sequences"] == len(w.seqs) and 0 <= j["lease_ms"] <= j["attached_ms"] + 1000, j
    out = ok_text(ctx, "workers")
    for w in ctx.workers:
        line = [l for l in out.splitlines() if l.endswith(" " + w.name)]
        assert line and str(w.proc.pid) in line[0] and " open " in line[0], (w.name, out)


def check_seqs(ctx):
    seqs = {q["seq_id"]: q for q in ok_json(ctx, "seqs")["sequences"]}
    assert len(seqs) == 5
    for w in ctx.workers:
        for sid in w.seqs:
            q = seqs[sid]
            assert q["session_id"] == w.session and q["policy"] == w.policy, q
            assert q["label"] == w.label and q["appended"] == w.tokens, q
            tiers = {t["tier"]: t for t in q["tiers"]}
            assert [t["tier"] for t in q["tiers"]] == ["full", "int8", "int4", "int2", "sketch"], q
            assert tiers["full"]["tokens"] == q["tokens"] and tiers["full"]["bytes"] == q["bytes"]
            assert all(tiers[t]["tokens"] == 0 for t in ("int8", "int4", "int2", "sketch")), q
    for sid in ctx.full.seqs + ctx.h2o.seqs + ctx.victim.seqs:
        assert seqs[sid]["tokens"] == LAYERS * seqs[sid]["appended"], seqs[sid]
    held = streaming_held(60, 6, 2, 10)
    (sid,) = ctx.stream.seqs
    assert seqs[sid]["tokens"] == LAYERS * len(held), (seqs[sid], held)
    out = ok_text(ctx, "seqs")
    for sid, q in seqs.items():
        line = [l for l in out.splitlines() if l.split() and l.split()[0] == str(sid)]
        assert line and q["policy"] in line[0] and line[0].endswith(q["label"]), (sid, out)


def check_seq_show(ctx):
    (sid,) = ctx.stream.seqs
    j = ok_json(ctx, "seq", "show", str(sid))
    assert j["sequence"]["seq_id"] == sid and j["sequence"]["policy"] == "streaming"
    params = {p["key"]: p["value"] for p in j["params"]}
    assert params == {"n_sink": "2", "window": "10", "demote": "off", "int8": "off",
                      "int8_window": "32", "demote_keep": "0",
                      "victims": "evict", "sketch_rows": "3", "sketch_buckets": "64",
                      "sketch_seed": "0"}, params
    held = streaming_held(60, 6, 2, 10)
    assert len(j["layers"]) == LAYERS and len(j["maps"]) == LAYERS
    for ly, m in zip(j["layers"], j["maps"]):
        assert ly["tokens"] == len(held) and ly["first_position"] == held[0]
        assert ly["last_position"] == held[-1] and ly["tokens_int8"] == 0
        assert m["layer"] == ly["layer"] and m["per_head"] is False
        assert m["runs"] == runs_of(held, 60), (m["runs"], held)
        assert not m.get("truncated")
    assert isinstance(j["retired"], list)
    sid_full = ctx.full.seqs[0]
    j = ok_json(ctx, "seq", "show", str(sid_full))
    assert all(m["runs"] == [{"first_position": 0, "count": 40, "tier": "full"}]
               for m in j["maps"]), j["maps"]
    out = ok_text(ctx, "seq", "show", str(sid))
    gap_end = held[2] - 1
    assert f"seq {sid}: session {ctx.stream.session}, policy streaming" in out, out
    assert "params: n_sink=2 window=10" in out and "table epoch" in out, out
    assert f"runs: 0-1 full, 2-{gap_end} evicted, {held[2]}-59 full" in out, out
    assert out.count("    |") == LAYERS, out
    # --max-runs cuts the map and says so.
    j = ok_json(ctx, "seq", "show", str(sid), "--max-runs", "1")
    assert all(m["truncated"] and len(m["runs"]) == 1 for m in j["maps"]), j["maps"]


def check_policy_list(ctx):
    j = ok_json(ctx, "policy", "list")
    pol = {p["name"]: p for p in j["policies"]}
    assert list(pol) == list(ctx.daemon.stats().policies), "not the registry order"
    s = pol["streaming"]
    assert [(p["key"], p["default_value"]) for p in s["params"]] == \
        [("n_sink", "4"), ("window", "1020")], s
    assert all(p["help"] for p in s["params"]) and s["needs"] == []
    assert pol["h2o"]["needs"] == ["score"] and pol["adakv"]["per_head"] is True
    assert {n for n, p in pol.items() if p["operator_evict"]} == {"full", "streaming"}
    assert pol["full"]["params"] == []
    assert [(p["key"], p["default_value"]) for p in j["storage_params"]] == \
        [("demote", "off"), ("int8", "off"), ("int8_window", "32"), ("demote_keep", "0"),
         ("victims", "evict"),
         ("sketch_rows", "3"),
         ("sketch_buckets", "64"), ("sketch_seed", "0")], j["storage_params"]
    out = ok_text(ctx, "policy", "list")
    assert "n_sink=4" in out and "window=1020" in out and "operator evict: yes" in out, out
    assert "storage keys, accepted by every policy" in out and "victims=evict" in out, out
    assert ok_json(ctx, "policies") == j


def check_evict_changes_the_sequence(ctx):
    (sid,) = ctx.victim.seqs
    before = ok_json(ctx, "seq", "show", str(sid))
    # Positions 8-15 fill block 1 of every layer (8 tokens a block): it is retired.
    r = ok_json(ctx, "evict", str(sid), "8-15")
    assert r == {"epoch": before["sequence"]["epoch"] + 1, "evicted": 3 * 8, "requested": 3 * 8,
                 "by_policy": 0, "not_held": 0, "moved": 0}, r
    j = ok_json(ctx, "seq", "show", str(sid))
    assert j["sequence"]["tokens"] == LAYERS * (64 - 8)
    for m in j["maps"]:
        assert m["runs"] == [{"first_position": 0, "count": 8, "tier": "full"},
                             {"first_position": 8, "count": 8, "tier": "evicted"},
                             {"first_position": 16, "count": 48, "tier": "full"}], m
    assert j["retired"] == [{"epoch": r["epoch"], "blocks": LAYERS}], j["retired"]
    # One layer, a list and a range, some already gone.
    r = ok_json(ctx, "evict", str(sid), "3,9-10,60-63", "--layer", "1")
    assert (r["evicted"], r["requested"], r["not_held"]) == (5, 5, 2), r
    out = ok_text(ctx, "seq", "show", str(sid))
    assert "runs: 0-2 full, 3 evicted, 4-7 full, 8-15 evicted, 16-59 full, 60-63 evicted" in out
    out = ok_text(ctx, "evict", str(sid), "0", "--layer", "2")
    assert f"seq {sid}: evicted 1 token(s)" in out, out
    # A streaming sequence's own rule runs first (as at its next step).
    (ssid,) = ctx.stream.seqs
    r = ok_json(ctx, "evict", str(ssid), "0")
    assert r["requested"] == LAYERS, r
    # Refusals: beyond the appended positions, a bad layer, a stateful policy.
    fails(ctx, 1, "beyond sequence", "evict", str(sid), "64")
    fails(ctx, 1, "layer 7 is out of range", "evict", str(sid), "1", "--layer", "7")
    fails(ctx, 1, "per-token state", "evict", str(ctx.h2o.seqs[0]), "1")
    # The worker still reads back exactly what it wrote for every token left.
    result = ctx.victim.finish()
    assert result["ok"] and result["checked"] > 0, result
    ctx.workers.remove(ctx.victim)


def check_watch_sees_a_worker_and_an_eviction(ctx):
    watch = subprocess.Popen([CLI, "--socket", ctx.daemon.sock, "watch", "--json", "--timeout",
                              "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True)
    reader.start()

    def wait_for(pred, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = [json.loads(l) for l in list(lines)]
            if any(pred(e) for e in events):
                return events
            time.sleep(0.05)
        return None

    # nanomsg subscribes in the background: attach short-lived probe workers
    # until the feed shows one, so that nothing below is missed.
    for i in range(20):
        probe = Worker(ctx.daemon, f"cli-probe{i}", seed=40 + i, tokens=1)
        probe.finish()
        # Its last event: everything before it has arrived too (one publisher, in order).
        if wait_for(lambda e, pid=probe.proc.pid: e["topic"] == "worker.reclaimed" and
                    e["pid"] == pid, 1.0):
            break
    else:
        raise AssertionError("kvstash watch saw none of 20 probe workers")
    mark = len(lines)
    w = Worker(ctx.daemon, "cli-watched", seed=31, tokens=24, step=8, policy="streaming",
               params=("n_sink=0", "window=1000")).ready()
    (seq,) = [q.seq_id for q in ctx.daemon.stats().sequences if q.session_id == w.session_id()]
    ok_json(ctx, "evict", str(seq), "0-7")
    w.finish()
    assert wait_for(lambda e: e["topic"] == "worker.reclaimed" and e["pid"] == w.proc.pid, 30), \
        f"no worker.reclaimed for the watched worker: {lines}"
    watch.send_signal(signal.SIGINT)
    assert watch.wait(30) == 0, watch.stderr.read()
    reader.join(10)
    events = [json.loads(l) for l in lines[mark:]]
    topics = [e["topic"] for e in events]
    assert topics == ["worker.attached", "seq.created", "table.changed", "worker.reclaimed"], \
        events
    att, created, changed, gone = events
    assert att["pid"] == w.proc.pid and att["name"] == "cli-watched", att
    assert created["seq"] == seq and created["policy"] == "streaming", created
    assert changed == {**changed, "seq": seq, "evicted": LAYERS * 8, "by": "operator",
                       "op": "evict", "moved": 0}, changed
    assert gone["reason"] == "detach" and gone["session"] == att["session"], gone
    assert [e["n"] for e in events] == list(range(events[0]["n"], events[0]["n"] + 4))
    # Text mode with --topic, and no event in time: exits 0 at the timeout.
    rc, out, err = run(ctx, "watch", "--timeout", "0.5", "--topic", "seq.")
    assert rc == 0 and out == "" and err == "", (rc, out, err)


def verify_now(w):
    """Have a holding worker read and verify its tables: the VERIFIED counts."""
    w.proc.stdin.write("\n")
    w.proc.stdin.flush()
    line = w.wait_line("VERIFIED")
    return {k: int(v) for k, v in (f.split("=") for f in line.split()[1:])}


def tier_runs(*spans):
    """TierRun dicts of (first, last, tier) spans."""
    return [{"first_position": a, "count": b - a + 1, "tier": t} for a, b, t in spans]


def pool_accounted(ctx):
    """Every block of the pool not free is a sequence's (in a list, or retired)."""
    st = ok_json(ctx, "status")
    (pool,) = st["pools"]
    held = sum(q["blocks"] for q in st["sequences"])
    return pool["blocks_total"] - pool["blocks_free"] == held


@contextlib.contextmanager
def killed_on_failure(w):
    """A failing check does not leave its worker holding for the next checks."""
    try:
        yield w
    except BaseException:
        w.proc.kill()
        w.proc.wait()
        raise


def check_demote_offload_revive(ctx):
    w = Worker(ctx.daemon, "cli-tiers", seed=25, tokens=64, step=16, label="tiers").ready()
    with killed_on_failure(w):
        tier_moves_on_a_full_sequence(ctx, w)
    result = w.finish()
    assert result["ok"] and result["checked"] > 0, result


def tier_moves_on_a_full_sequence(ctx, w):
    """Demote, offload and revive by hand: the map of every list, the replies,
    retired blocks and the worker reading back what it wrote (verify_now)."""
    (sid,) = [q.seq_id for q in ctx.daemon.stats().sequences if q.session_id == w.session_id()]
    sid = str(sid)
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": 0, "sketch": 0}
    epoch = ok_json(ctx, "seq", "show", sid)["sequence"]["epoch"]
    full = tier_runs((0, 63, "full"))

    # demote: 40 tokens a list, an INT8 block's 28 and a partial one, at once.
    r = ok_json(ctx, "demote", sid, "0-39")
    assert r == {"epoch": epoch + 1, "evicted": 0, "requested": LAYERS * 40, "by_policy": 0,
                 "not_held": 0, "moved": LAYERS * 40}, r
    j = ok_json(ctx, "seq", "show", sid)
    assert all(m["runs"] == tier_runs((0, 39, "int8"), (40, 63, "full")) for m in j["maps"]), \
        j["maps"]
    # Blocks 0-4 of each list held positions 0-39: retired; two INT8 blocks took them.
    assert [(ly["tokens_int8"], ly["blocks"]) for ly in j["layers"]] == [(40, 3 + 2)] * LAYERS
    assert j["retired"] == [{"epoch": r["epoch"], "blocks": LAYERS * 5}], j["retired"]
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": LAYERS * 40, "sketch": 0}
    out = ok_text(ctx, "demote", sid, "30-41")  # 30-39 are INT8 already
    assert f"seq {sid}: demoted {LAYERS * 2} token(s) to int8, of {LAYERS * 12} held" in out, out
    assert f"({LAYERS * 10} were there already" in out and f"epoch {epoch + 2}" in out, out

    # offload: INT8 and full-precision tokens of layer 1 into its sketch; they stay in the list.
    r = ok_json(ctx, "offload", sid, "0-1,40-47", "--layer", "1")
    assert (r["requested"], r["moved"], r["not_held"], r["epoch"]) == (10, 10, 0, epoch + 3), r
    j = ok_json(ctx, "seq", "show", sid)
    layer1 = tier_runs((0, 1, "sketch"), (2, 39, "int8"), (40, 47, "sketch"), (48, 63, "full"))
    assert [m["runs"] for m in j["maps"]] == [tier_runs((0, 41, "int8"), (42, 63, "full")),
                                                layer1,
                                                tier_runs((0, 41, "int8"), (42, 63, "full"))]
    assert j["layers"][1]["tokens"] == 64 and j["layers"][1]["tokens_sketch"] == 10, j["layers"]
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": 42 + 38 + 42, "sketch": 10}

    # revive: sketch estimates (out of the sketch) and INT8 tokens back to full precision.
    out = ok_text(ctx, "revive", sid, "0-3,44-45,60-63", "--layer", "1")
    assert f"seq {sid}: revived 6 token(s) to full precision, of 10 held" in out, out
    assert "(4 were there already" in out, out
    # demote a sketch token: it leaves the sketch, then is quantised alone.
    r = ok_json(ctx, "demote", sid, "46", "--layer", "1")
    assert (r["requested"], r["moved"]) == (1, 1), r
    # Every INT8 token of layer 0 back: its INT8 blocks are retired.
    r = ok_json(ctx, "revive", sid, "0-63", "--layer", "0")
    assert (r["requested"], r["moved"], r["evicted"]) == (64, 42, 0), r
    j = ok_json(ctx, "seq", "show", sid)
    assert [m["runs"] for m in j["maps"]] == [
        full,
        tier_runs((0, 3, "full"), (4, 39, "int8"), (40, 43, "sketch"), (44, 45, "full"),
                  (46, 46, "int8"), (47, 47, "sketch"), (48, 63, "full")),
        tier_runs((0, 41, "int8"), (42, 63, "full"))], j["maps"]
    # Layer 0's three INT8 blocks (two from the first demote, one from the second) go.
    assert j["layers"][0]["tokens_int8"] == 0, j["layers"]
    assert {"epoch": r["epoch"], "blocks": 3} in j["retired"], (r, j["retired"])
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": 37 + 42, "sketch": 5}
    tiers = {t["tier"]: t["tokens"] for t in ok_json(ctx, "status")["tiers"]}
    assert (tiers["int8"], tiers["sketch"]) == (37 + 42, 5), tiers
    assert pool_accounted(ctx)
    # Sketch tokens demoted: revived into fresh blocks that the INT8 blocks
    # empty again in the same step; those blocks are retired, not lost.
    ok_json(ctx, "offload", sid, "0-39", "--layer", "0")
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": 37 + 42, "sketch": 40 + 5}
    r = ok_json(ctx, "demote", sid, "0-39", "--layer", "0")
    assert (r["requested"], r["moved"]) == (40, 40), r
    assert ok_json(ctx, "seq", "show", sid)["maps"][0]["runs"] == \
        tier_runs((0, 39, "int8"), (40, 63, "full"))
    assert pool_accounted(ctx)
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": 40 + 37 + 42, "sketch": 5}
    revive_by_the_full_tiers_old_name(ctx, w, sid, full)


def revive_by_the_full_tiers_old_name(ctx, w, sid, full):
    """The full tier was named "fp16" before (issue 15 item 1): Evict's `to`
    still takes it, for what to="full" does. Layer 0's INT8 positions 0-19 go
    back by one name, 20-39 by the other."""
    hello, token = fd_hello(ctx.daemon.sock)  # a session as the CLI's: an operator's
    md = (("kvstash-token", token),)
    try:
        for to, first in (("full", 0), ("fp16", 20)):
            req = pb.EvictRequest(seq_id=int(sid), to=to, layers=[0],
                                  ranges=[pb.PositionRange(first=first, count=20)])
            r = call(ctx.daemon.store.Evict, req, md, f"Evict(to={to!r})")
            assert (r.requested, r.moved, r.evicted, r.not_held) == (20, 20, 0, 0), (to, r)
        req = pb.EvictRequest(seq_id=int(sid), to="fp32",
                              ranges=[pb.PositionRange(first=0, count=1)])
        msg = expect_status(ctx.daemon.store.Evict, req, grpc.StatusCode.INVALID_ARGUMENT, md,
                            "Evict(to='fp32')")
        assert '"full" (or "fp16")' in msg, msg
    finally:
        hello.close()
    assert ok_json(ctx, "seq", "show", sid)["maps"][0]["runs"] == full
    assert pool_accounted(ctx)
    assert verify_now(w) == {"checked": LAYERS * 64, "int8": 37 + 42, "sketch": 5}


def check_int8_compaction_requantises(ctx):
    """Evicting most INT8 tokens re-quantises the survivors into fresh INT8
    blocks (POLICIES.md §5.4 compaction), which frees the old ones; the
    worker reads them within two quantisations' bound."""
    # streaming with a window that keeps everything: the worker's check that
    # policy full holds every position would refuse the evictions.
    w = Worker(ctx.daemon, "cli-requant", seed=27, tokens=96, step=16, policy="streaming",
               params=("n_sink=0", "window=1000"), label="requant").ready()
    with killed_on_failure(w):
        (sid,) = [str(q.seq_id) for q in ctx.daemon.stats().sequences
                  if q.session_id == w.session_id()]
        scrape = Scrape(metrics_port(ctx.daemon))
        before = scrape.get("kvstash_int8_requantized_tokens_total", policy="streaming")
        # 84 tokens a list = three INT8 blocks of 28; 84-87 stay in block 10.
        ok_json(ctx, "demote", sid, "0-83")
        j = ok_json(ctx, "seq", "show", sid)
        assert [(ly["tokens_int8"], ly["blocks"]) for ly in j["layers"]] == [(84, 3 + 2)] * LAYERS
        assert verify_now(w) == {"checked": LAYERS * 96, "int8": LAYERS * 84, "sketch": 0}
        # Keep every third: 28 survivors over 3 INT8 blocks fit in one.
        gone = ",".join(str(p) for p in range(84) if p % 3)
        r = ok_json(ctx, "evict", sid, gone)
        assert (r["evicted"], r["moved"]) == (LAYERS * 56, 0), r
        j = ok_json(ctx, "seq", "show", sid)
        assert [(ly["tokens_int8"], ly["blocks"]) for ly in j["layers"]] == [(28, 1 + 2)] * LAYERS
        assert {"epoch": r["epoch"], "blocks": LAYERS * 3} in j["retired"], j["retired"]
        assert verify_now(w) == {"checked": LAYERS * 40, "int8": LAYERS * 28, "sketch": 0}
        after = Scrape(metrics_port(ctx.daemon))
        assert after.get("kvstash_int8_requantized_tokens_total", policy="streaming") == \
            before + LAYERS * 28, after.text
        # Evicting a few more leaves one block: nothing to compact.
        r = ok_json(ctx, "evict", sid, "0,3,6")
        j = ok_json(ctx, "seq", "show", sid)
        assert [(ly["tokens_int8"], ly["blocks"]) for ly in j["layers"]] == [(25, 1 + 2)] * LAYERS
        assert verify_now(w) == {"checked": LAYERS * 37, "int8": LAYERS * 25, "sketch": 0}
        assert pool_accounted(ctx)
    result = w.finish()
    assert result["ok"], result


def check_demote_to_int4_and_int2(ctx):
    """`kvstash demote --to int4|int2` (issue 15): positions go into INT4 /
    INT2 blocks at once, the maps and layers count them, the worker reads
    them in place within half a group's step (INT4 then INT2: two rounds at
    INT2's bound), and revive brings them all back to full precision."""
    w = Worker(ctx.daemon, "cli-lowbit", seed=28, tokens=64, step=16, policy="streaming",
               params=("n_sink=0", "window=1000"), label="lowbit").ready()
    with killed_on_failure(w):
        (sid,) = [str(q.seq_id) for q in ctx.daemon.stats().sequences
                  if q.session_id == w.session_id()]
        r = ok_json(ctx, "demote", sid, "0-39", "--to", "int4")
        assert (r["requested"], r["moved"], r["evicted"]) == (LAYERS * 40, LAYERS * 40, 0), r
        j = ok_json(ctx, "seq", "show", sid)
        assert all(m["runs"] == tier_runs((0, 39, "int4"), (40, 63, "full")) for m in j["maps"]), \
            j["maps"]
        assert [(ly["tokens_int4"], ly["tokens_int8"]) for ly in j["layers"]] == [(40, 0)] * LAYERS
        assert verify_now(w) == {"checked": LAYERS * 64, "int8": 0, "sketch": 0}
        # 30-39 come back from INT4 and go to INT2 with 40-49.
        out = ok_text(ctx, "demote", sid, "30-49", "--to", "int2")
        assert f"seq {sid}: demoted {LAYERS * 20} token(s) to int2, of {LAYERS * 20} held" in out, \
            out
        j = ok_json(ctx, "seq", "show", sid)
        assert all(m["runs"] == tier_runs((0, 29, "int4"), (30, 49, "int2"), (50, 63, "full"))
                   for m in j["maps"]), j["maps"]
        assert [(ly["tokens_int4"], ly["tokens_int2"]) for ly in j["layers"]] == \
            [(30, 20)] * LAYERS
        text = ok_text(ctx, "seq", "show", sid)
        assert "4 int4  2 int2" in text and "int4 30, int2 20" in text, text
        tiers = {t["tier"]: t for t in [q for q in ok_json(ctx, "seqs")["sequences"]
                                        if str(q["seq_id"]) == sid][0]["tiers"]}
        assert (tiers["int4"]["tokens"], tiers["int2"]["tokens"]) == \
            (LAYERS * 30, LAYERS * 20), tiers
        assert verify_now(w) == {"checked": LAYERS * 64, "int8": 0, "sketch": 0}
        r = ok_json(ctx, "revive", sid, "0-63")
        assert r["moved"] == LAYERS * 50, r
        j = ok_json(ctx, "seq", "show", sid)
        assert all(m["runs"] == tier_runs((0, 63, "full")) for m in j["maps"]), j["maps"]
        assert verify_now(w) == {"checked": LAYERS * 64, "int8": 0, "sketch": 0}
        assert pool_accounted(ctx)
    result = w.finish()
    assert result["ok"], result


def check_tier_moves_after_the_policy_rule(ctx):
    """streaming's rule runs first; requested positions it drops are not held."""
    w = Worker(ctx.daemon, "cli-tiers-stream", seed=26, tokens=32, step=16, policy="streaming",
               params=("n_sink=0", "window=20")).ready()
    with killed_on_failure(w):
        (sid,) = [q.seq_id for q in ctx.daemon.stats().sequences
                  if q.session_id == w.session_id()]
        r = ok_json(ctx, "offload", str(sid), "8-15")  # the window drops 0-11 now
        assert (r["evicted"], r["by_policy"], r["requested"], r["not_held"], r["moved"]) == \
            (LAYERS * 12, LAYERS * 12, LAYERS * 4, LAYERS * 4, LAYERS * 4), r
        j = ok_json(ctx, "seq", "show", str(sid))
        assert all(m["runs"] == tier_runs((0, 11, "evicted"), (12, 15, "sketch"),
                                          (16, 31, "full")) for m in j["maps"]), j["maps"]
        assert verify_now(w) == {"checked": LAYERS * 20, "int8": 0, "sketch": LAYERS * 4}
        assert pool_accounted(ctx)
    result = w.finish()
    assert result["ok"], result


def check_tier_move_refusals(ctx):
    """As for evict: a stateful policy, no sequence, bad positions or layer."""
    sid, h2o = str(ctx.full.seqs[0]), str(ctx.h2o.seqs[0])
    for op in ("demote", "offload", "revive"):
        line = fails(ctx, 1, "per-token state", op, h2o, "1")
        assert f"{op} works on policies full and streaming" in line, line
        fails(ctx, 4, "no sequence 424242", op, "424242", "1")
        fails(ctx, 2, "positions are N, A-B", op, sid, "x")
        fails(ctx, 1, "beyond sequence", op, sid, "40")
        fails(ctx, 1, "layer 7 is out of range", op, sid, "1", "--layer", "7")


def check_errors_daemon_not_running(ctx):
    with tempfile.TemporaryDirectory(prefix="kvstash-cli.") as tmp:
        missing = os.path.join(tmp, "none.sock")
        for args in (["status"], ["health"], ["workers"], ["seqs"], ["seq", "show", "1"],
                     ["policy", "list"], ["evict", "1", "2"], ["watch"], ["top"],
                     ["demote", "1", "2"]):
            fails(missing, 3, "kvstashd is not running", *args)
        stale = os.path.join(tmp, "stale.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(stale)
        s.close()  # the file stays, nothing listens
        fails(stale, 3, "stale socket", "status", "--json")


def check_errors_unknown_sequence(ctx):
    for args in (["seq", "show", "999999"], ["evict", "999999", "1"], ["--json", "seq", "show",
                                                                       "999999"]):
        fails(ctx, 4, "no sequence 999999", *args)


def check_errors_permission_denied(ctx):
    if os.getuid() == 0:
        # The daemon's socket directory is 0700: another user cannot reach it.
        def as_nobody():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        for args in (["status"], ["seq", "show", "1"], ["evict", "1", "2"]):
            fails(ctx, 5, "permission denied", *args, preexec=as_nobody)
    else:
        with tempfile.TemporaryDirectory(prefix="kvstash-cli.") as tmp:
            locked = os.path.join(tmp, "locked")
            os.mkdir(locked, 0o000)
            try:
                fails(os.path.join(locked, "k.sock"), 5, "permission denied", "status")
            finally:
                os.chmod(locked, 0o700)


def check_errors_usage(ctx):
    fails(ctx, 2, "unknown command", "frobnicate")
    fails(ctx, 2, "unknown option --bogus", "status", "--bogus")
    fails(ctx, 2, "missing argument", "seq", "show")
    fails(ctx, 2, "sequence id must be a number", "seq", "show", "abc")
    fails(ctx, 2, "wants a subcommand", "seq")
    fails(ctx, 2, "unknown subcommand frob", "policy", "frob")
    fails(ctx, 2, "positions are N, A-B", "evict", "1", "5-2")
    fails(ctx, 2, "missing argument", "evict", "1")
    fails(ctx, 2, "--layer wants a layer number", "evict", "1", "2", "--layer", "x")
    fails(ctx, 2, "--to wants int8, int4 or int2, got 'int3'", "demote", "1", "2", "--to", "int3")
    fails(ctx, 2, "--to is demote's option", "evict", "1", "2", "--to", "int4")
    fails(ctx, 2, "--count wants a positive number", "watch", "--count", "0")
    fails(ctx, 2, "--sort wants", "top", "--sort", "size")
    fails(ctx, 2, "unexpected argument", "workers", "extra")
    rc, _, err = run(ctx)  # no command at all
    assert rc == 2 and err.startswith("usage: kvstash"), (rc, err)


def check_top_without_a_terminal(ctx):
    j = [json.loads(l) for l in ok_text(ctx, "top", "--json", "--iterations", "2",
                                         "--interval", "0.1").splitlines()]
    assert len(j) == 2 and all(len(x["sequences"]) == 4 for x in j), j
    out = ok_text(ctx, "top", "--iterations", "1", "--sort", "seq")
    assert "WORKERS" in out and "SEQUENCES (by seq)" in out, out
    for w in ctx.workers:
        assert w.name in out, (w.name, out)


def check_seq_show_per_head_lists(ctx):
    """A per-head policy (adakv) keeps one list per KV head: one map each.
    The worker here is the Python gRPC client of the harness."""
    w = HarnessWorker(ctx.daemon)
    try:
        w.attach(model="perhead")
        created = call(ctx.daemon.store.CreateSequence,
                       pb.CreateSequenceRequest(policy="adakv", params=[
                           pb.Param(key="budget", value="16"), pb.Param(key="window", value="4")]),
                       w.md)
        call(ctx.daemon.store.Append, pb.AppendRequest(seq_id=created.seq_id, count=20), w.md)
        j = ok_json(ctx, "seq", "show", str(created.seq_id))
        g = w.attached.geometry
        assert len(j["maps"]) == g.layers * g.kv_heads, j["maps"]
        assert [(m["layer"], m["head"], m["per_head"]) for m in j["maps"]] == \
            [(l, h, True) for l in range(g.layers) for h in range(g.kv_heads)]
        assert all(m["runs"] == [{"first_position": 0, "count": 20, "tier": "full"}]
                   for m in j["maps"]), j["maps"]
        assert all(ly["tokens"] == 20 * g.kv_heads for ly in j["layers"]), j["layers"]
        out = ok_text(ctx, "seq", "show", str(created.seq_id))
        assert out.count("   head 1:") == g.layers, out
        fails(ctx, 1, "per-token state", "evict", str(created.seq_id), "0")
    finally:
        w.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ctx.daemon.stats().pools and any(
            p.model == "perhead" for p in ctx.daemon.stats().pools):
        time.sleep(0.05)


def check_workers_finish_cleanly(ctx):
    for w in list(ctx.workers):
        result = w.finish()
        assert result["ok"], result
        ctx.workers.remove(w)
    st = ok_json(ctx, "status")
    assert st["sessions"] == [] and st["sequences"] == [], st


if __name__ == "__main__":
    sys.exit(run_tests("cli", [
        check_help_at_every_level,
        check_start_workers,
        check_status,
        check_workers,
        check_seqs,
        check_seq_show,
        check_policy_list,
        check_evict_changes_the_sequence,
        check_watch_sees_a_worker_and_an_eviction,
        check_demote_offload_revive,
        check_int8_compaction_requantises,
        check_demote_to_int4_and_int2,
        check_tier_moves_after_the_policy_rule,
        check_tier_move_refusals,
        check_errors_daemon_not_running,
        check_errors_unknown_sequence,
        check_errors_permission_denied,
        check_errors_usage,
        check_top_without_a_terminal,
        check_seq_show_per_head_lists,
        check_workers_finish_cleanly,
    ], daemon_kwargs={"pool_mb": 16, "extra_args": ["--metrics", "127.0.0.1:0"]}))
