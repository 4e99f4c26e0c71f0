"""kvstashd's Prometheus endpoint, health while shutting down, and the config
file (issue 6, acceptance 2).

A real kvstashd serves /metrics (libmicrohttpd, `--metrics 127.0.0.1:0`); the
test scrapes it and parses every scrape with prometheus_client's text parser
(Debian's python3-prometheus-client), then checks that the counters move as
real workers act, against what the workers did:

* kvs_test_worker processes (gRPC + ring appends): workers, sequences, tokens
  per tier, appended and evicted tokens, pool blocks and memory, RPC counts
  and latency histograms, reclaimed workers;
* kvs_policy_worker processes (per-step ring STEPs with attention): the step
  latency histogram, and the attention mass each eviction dropped, recomputed
  here from the worker's own trace and `kvstash replay`'s evictions;
* an operator eviction through `kvstash evict`.

Then: the endpoint refuses non-loopback addresses unless allowed; /healthz;
a daemon with --drain-ms reports NOT_SERVING (gRPC health, /healthz, the
kvstash_serving gauge, `kvstash status`) between SIGTERM and its exit; and
`kvstashd --config FILE --print-config` shows defaults < file < flags.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvstash_harness import Daemon, health_pb2, run_tests
from worker_procs import WorkerProc

CLI = os.environ.get("KVSTASH_CLI", "")
KVSTASHD = os.environ.get("KVSTASHD", "")
POLICY_GEOM = ["--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8",
               "--block-tokens", "4"]
LAYERS, Q_HEADS, KV_HEADS = 3, 4, 2  # worker_procs.GEOMETRY


def metrics_port(daemon, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"msg=metrics_listening addr=[0-9.]+:(\d+)", daemon.log())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no metrics_listening line in the log\n{daemon.log_tail()}")


def http_get(port, path, method="GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


class Scrape:
    """One parsed scrape: samples by (name, sorted label items)."""

    def __init__(self, port):
        status, ctype, text = http_get(port, "/metrics")
        assert status == 200, f"/metrics answered {status}: {text[:200]}"
        assert ctype.startswith("text/plain; version=0.0.4"), f"Content-Type {ctype!r}"
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {}
        for fam in self.families.values():
            for s in fam.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"no sample {name}{labels} in the scrape"
        return self.samples[key]

    def sum(self, name, **labels):
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for (n, items), v in self.samples.items():
            d = dict(items)
            if n == name and all(d.get(k) == val for k, val in labels.items()):
                total += v
        return total


def cli(ctx, *args):
    p = subprocess.run([CLI, "--socket", ctx.daemon.sock, *args], capture_output=True,
                       text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def check_scrape_parses_with_types(ctx):
    ctx.port = metrics_port(ctx.daemon)
    s = Scrape(ctx.port)
    want = {"kvstash_build_info": "gauge", "kvstash_serving": "gauge",
            "kvstash_pool_blocks": "gauge", "kvstash_memory_bytes": "gauge",
            "kvstash_workers": "gauge", "kvstash_sequences": "gauge", "kvstash_tokens": "gauge",
            "kvstash_appended_tokens": "counter", "kvstash_evicted_tokens": "counter",
            "kvstash_rpc_requests": "counter", "kvstash_rpc_duration_seconds": "histogram",
            "kvstash_step_duration_seconds": "histogram",
            "kvstash_eviction_attention_dropped_ratio": "histogram",
            "kvstash_workers_reclaimed": "counter", "kvstash_events_published": "counter",
            "kvstash_backend_info": "gauge", "kvstash_quarantined_sessions": "gauge",
            "kvstash_quarantined_blocks": "gauge"}
    for name, kind in want.items():
        assert name in s.families, f"family {name} missing; have {sorted(s.families)}"
        assert s.families[name].type == kind, f"{name} is {s.families[name].type}, not {kind}"
    assert s.get("kvstash_serving") == 1
    assert s.get("kvstash_workers") == 0 and s.sum("kvstash_sequences") == 0
    # Where pools live (issue 14): host memory has no device, workers map a memfd.
    st = ctx.daemon.stats()
    assert (st.device, st.device_name, st.ipc) == ("none", "", "memfd"), st
    assert s.get("kvstash_backend_info", backend=ctx.daemon.backend, device=st.device,
                 device_name=st.device_name, ipc=st.ipc) == 1
    assert len(s.families["kvstash_backend_info"].samples) == 1
    # --lease-end auto frees on host and shadow: nothing is ever quarantined.
    assert st.lease_end == "free", st.lease_end
    assert s.get("kvstash_quarantined_sessions") == 0 == s.get("kvstash_quarantined_blocks")
    ctx.base = s


def check_counters_move_as_test_workers_act(ctx):
    base = ctx.base
    full = WorkerProc(ctx.daemon, "m-full", seed=11, tokens=64, step=8, sequences=2, hold=True,
                      model="metrics")
    stream = WorkerProc(ctx.daemon, "m-stream", seed=12, tokens=60, step=6, policy="streaming",
                        params=("n_sink=2", "window=10"), hold=True, model="metrics")
    for w in (full, stream):
        w.wait_line("READY")
    s = Scrape(ctx.port)
    st = ctx.daemon.stats()
    assert s.get("kvstash_workers") == 2
    assert s.get("kvstash_sequences", policy="full") == 2
    assert s.get("kvstash_sequences", policy="streaming") == 1
    held = {q.policy: 0 for q in st.sequences}
    for q in st.sequences:
        held[q.policy] += q.tokens
    assert s.get("kvstash_tokens", policy="full", tier="full") == 2 * LAYERS * 64 == held["full"]
    assert s.get("kvstash_tokens", policy="streaming", tier="full") == held["streaming"]
    assert s.get("kvstash_tokens", policy="streaming", tier="int8") == 0
    d_app = (s.get("kvstash_appended_tokens_total", policy="full")
             - base.get("kvstash_appended_tokens_total", policy="full"))
    assert d_app == 2 * 64, f"appended tokens moved by {d_app}, the worker appended 2 x 64"
    assert (s.get("kvstash_appended_tokens_total", policy="streaming")
            - base.get("kvstash_appended_tokens_total", policy="streaming")) == 60
    # What streaming evicted is what it appended minus what it holds.
    d_ev = (s.get("kvstash_evicted_tokens_total", policy="streaming", by="policy")
            - base.get("kvstash_evicted_tokens_total", policy="streaming", by="policy"))
    assert d_ev == LAYERS * 60 - held["streaming"] > 0, (d_ev, held)
    assert s.get("kvstash_evicted_tokens_total", policy="full", by="policy") == 0
    # Pools and memory agree with Stats.
    (pool,) = [p for p in st.pools if p.model == "metrics"]
    lab = {"pool": str(pool.pool_id), "model": "metrics"}
    for state, v in (("free", pool.blocks_free), ("used", pool.blocks_used),
                     ("retired", pool.blocks_retired),
                     ("quarantined", pool.blocks_quarantined)):
        assert s.get("kvstash_pool_blocks", state=state, **lab) == v, (state, v)
    assert s.get("kvstash_pool_capacity_bytes", **lab) == pool.bytes_total
    assert s.get("kvstash_memory_bytes", tier="full", **lab) == \
        (pool.blocks_total - pool.blocks_free) * pool.block_bytes
    # gRPC: two Attach calls, each in the latency histogram.
    rpc = dict(service="kvstash.v1.Store", method="Attach")
    assert (s.get("kvstash_rpc_requests_total", code="OK", **rpc)
            - base.get("kvstash_rpc_requests_total", code="OK", **rpc)) == 2
    count = s.get("kvstash_rpc_duration_seconds_count", **rpc)
    assert count == s.get("kvstash_rpc_requests_total", code="OK", **rpc)
    assert s.get("kvstash_rpc_duration_seconds_bucket", le="+Inf", **rpc) == count
    assert 0 < s.get("kvstash_rpc_duration_seconds_sum", **rpc) < count * 5
    # An operator eviction (streaming holds its sinks 0 and 1: drop position 1).
    seq = [q.seq_id for q in st.sequences if q.policy == "streaming"][0]
    rc, out, err = cli(ctx, "--json", "evict", str(seq), "1")
    assert rc == 0, err
    s2 = Scrape(ctx.port)
    assert (s2.get("kvstash_evicted_tokens_total", policy="streaming", by="operator")
            - s.get("kvstash_evicted_tokens_total", policy="streaming", by="operator")) == \
        json.loads(out)["requested"] == LAYERS
    assert s2.get("kvstash_rpc_requests_total", code="OK", service="kvstash.v1.Store",
                  method="Evict") >= 1
    # A refused call is counted under its code.
    rc, _, _ = cli(ctx, "seq", "show", "987654")
    assert rc == 4
    s3 = Scrape(ctx.port)
    assert s3.get("kvstash_rpc_requests_total", code="NOT_FOUND", service="kvstash.v1.Store",
                  method="Inspect") >= 1
    for w in (full, stream):
        w.finish()
    s4 = Scrape(ctx.port)
    assert s4.get("kvstash_workers") == 0 and s4.sum("kvstash_sequences") == 0
    assert (s4.get("kvstash_workers_reclaimed_total", reason="detach")
            - base.get("kvstash_workers_reclaimed_total", reason="detach")) == 2
    assert s4.get("kvstash_events_published_total") > base.get("kvstash_events_published_total")


def run_policy_worker(ctx, policy, params, arrays, trace):
    args = [os.environ["KVSTASH_POLICY_WORKER"], "--socket", ctx.daemon.sock, "--model", "mstep",
            "--policy", policy, "--prefill", "24", "--steps", "40", "--seed", "5", "--trace",
            trace, "--arrays", arrays, *POLICY_GEOM]
    for p in params:
        args += ["--set", p]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{policy} worker: {p.stdout[-300:]!r} {p.stderr[-300:]!r}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def expected_dropped_mass(policy, params, trace):
    """Per (step, layer) that evicted: the fraction of the step's attention
    on the evicted tokens, from the trace's statistics and replay's answers."""
    args = [CLI, "replay", "--policy", policy, *POLICY_GEOM]
    for p in params:
        args += ["--set", p]
    with open(trace) as f:
        ops = [json.loads(line) for line in f if line.strip()]
    with open(trace) as f:
        p = subprocess.run(args, stdin=f, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    answers = iter(json.loads(line) for line in p.stdout.splitlines() if line.strip())
    group = Q_HEADS // KV_HEADS
    held, appended, observed = None, 0, []
    for op in ops:
        assert list(op) == ["step"], f"unexpected trace operation {op}"
        st, ans = op["step"], next(answers)
        per_head = ans["evicted"] and ans["evicted"][0] and isinstance(ans["evicted"][0][0], list)
        nlists = KV_HEADS if per_head else 1
        if held is None:
            held = [[[] for _ in range(nlists)] for _ in range(2)]
        n = st.get("new_tokens", 0)
        for layer in held:
            for lst in layer:
                lst.extend(range(appended, appended + n))
        appended += n
        for l in range(2):
            weights = []
            for k in range(nlists):
                if "score" in st:
                    w = st["score"][l]
                else:
                    arr = st.get("last_attn") or st["window_attn"]
                    qs = [h for h in range(Q_HEADS) if nlists == 1 or h // group == k]
                    w = [sum(arr[l][h][i] for h in qs) for i in range(len(held[l][k]))]
                weights.append(w)
            ev = ans["evicted"][l] if per_head else [ans["evicted"][l]]
            gone = [set(e) for e in ev]
            dropped = sum(w for k in range(nlists) for p, w in zip(held[l][k], weights[k])
                          if p in gone[k])
            total = sum(sum(w) for w in weights)
            if any(gone) and total > 0:
                observed.append(min(1.0, max(0.0, dropped / total)))
            for k in range(nlists):
                held[l][k] = [p for p in held[l][k] if p not in gone[k]]
    return observed


def check_ring_steps_and_attention_mass_dropped(ctx):
    for policy, params, arrays in (("h2o", ["budget=16"], "score"),
                                   ("adakv", ["budget=16", "window=4", "kernel=3"], "window")):
        before = Scrape(ctx.port)
        trace = os.path.join(ctx.daemon.dir, f"metrics-{policy}.jsonl")
        result = run_policy_worker(ctx, policy, params, arrays, trace)
        after = Scrape(ctx.port)
        d = lambda name, **lab: after.get(name, **lab) - before.get(name, **lab)  # noqa: E731
        steps = d("kvstash_step_duration_seconds_count", policy=policy)
        assert steps == result["steps"] + 1, f"{policy}: {steps} steps, worker ran prefill + " \
                                             f"{result['steps']}"
        assert d("kvstash_step_duration_seconds_sum", policy=policy) > 0
        assert d("kvstash_appended_tokens_total", policy=policy) == 24 + 40
        assert d("kvstash_evicted_tokens_total", policy=policy, by="policy") > 0
        want = expected_dropped_mass(policy, params, trace)
        assert want, f"{policy}: the trace has no eviction"
        got_n = d("kvstash_eviction_attention_dropped_ratio_count", policy=policy)
        got_sum = d("kvstash_eviction_attention_dropped_ratio_sum", policy=policy)
        assert got_n == len(want), f"{policy}: {got_n} observations, expected {len(want)}"
        assert abs(got_sum - sum(want)) < 1e-5, f"{policy}: sum {got_sum} != {sum(want)}"
        le = after.get("kvstash_eviction_attention_dropped_ratio_bucket", policy=policy,
                       le="0.1") - before.get("kvstash_eviction_attention_dropped_ratio_bucket",
                                              policy=policy, le="0.1")
        assert le == sum(1 for x in want if x <= 0.1 + 1e-12), (le, want)


def check_ops_files_match_the_metrics(ctx):
    """The Grafana dashboard queries only metrics kvstashd exports, and the
    example config is a valid config."""
    ops = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ops")
    with open(os.path.join(ops, "grafana", "kvstash-dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bkvstash_[a-z_]+", e)}
    # Declared families (# TYPE), present even while no pool exists.
    types = set(re.findall(r"^# TYPE (\S+) ", Scrape(ctx.port).text, re.M))
    have = {t + s for t in types for s in ("", "_total", "_bucket", "_sum", "_count")}
    assert used and used <= have, f"the dashboard queries unknown metrics: {used - have}"
    p = subprocess.run([KVSTASHD, "--config", os.path.join(ops, "kvstashd.conf"),
                        "--print-config"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "metrics = 127.0.0.1:9464" in p.stdout, p.stdout + p.stderr


def check_http_paths(ctx):
    status, _, body = http_get(ctx.port, "/healthz")
    assert (status, body) == (200, "serving\n"), (status, body)
    status, _, _ = http_get(ctx.port, "/nope")
    assert status == 404
    status, _, _ = http_get(ctx.port, "/metrics", method="POST")
    assert status == 405


def check_metrics_listen_loopback_only(ctx):
    d = Daemon(extra_args=["--metrics", "0.0.0.0:0"])
    p = subprocess.run(d.args, capture_output=True, text=True, timeout=30)
    d.cleanup()
    assert p.returncode != 0, "kvstashd served /metrics on 0.0.0.0 without being allowed to"
    assert "not a loopback address" in p.stdout + p.stderr, p.stdout + p.stderr
    d = Daemon(extra_args=["--metrics", "0.0.0.0:0", "--metrics-allow-remote"])
    try:
        d.start()
        assert metrics_port(d) > 0
        d.stop()
    finally:
        d.kill()
        d.cleanup()


def check_not_serving_while_shutting_down(ctx):
    d = Daemon(extra_args=["--metrics", "127.0.0.1:0", "--drain-ms", "6000"])
    try:
        d.start()
        port = metrics_port(d)
        assert Scrape(port).get("kvstash_serving") == 1
        p = subprocess.run([CLI, "--socket", d.sock, "health"], capture_output=True, text=True,
                           timeout=30)
        assert (p.returncode, p.stdout) == (0, "SERVING\n"), (p.returncode, p.stdout)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        deadline = t0 + 3.0
        status = None
        while time.monotonic() < deadline:
            status = d.health()
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING, \
            f"health stayed {status} after SIGTERM"
        code, _, body = http_get(port, "/healthz")
        assert (code, body) == (503, "shutting down\n"), (code, body)
        p = subprocess.run([CLI, "--socket", d.sock, "health"], capture_output=True, text=True,
                           timeout=30)
        assert (p.returncode, p.stdout) == (1, "NOT_SERVING\n"), (p.returncode, p.stdout)
        assert Scrape(port).get("kvstash_serving") == 0
        p = subprocess.run([CLI, "--socket", d.sock, "status", "--json"], capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0 and json.loads(p.stdout)["serving"] is False, p.stdout
        p = subprocess.run([CLI, "--socket", d.sock, "status"], capture_output=True, text=True,
                           timeout=30)
        assert "shutting down" in p.stdout, p.stdout
        assert time.monotonic() - t0 < 5.5, "the checks overran the drain window"
        rc = d.proc.wait(30)
        assert rc == 0, f"exit {rc}\n{d.log_tail()}"
        assert "msg=draining ms=6000" in d.log()
        assert time.monotonic() - t0 >= 5.5, "kvstashd did not drain for --drain-ms"
    finally:
        d.kill()
        d.cleanup()


def check_config_file_and_print_config(ctx):
    with tempfile.TemporaryDirectory(prefix="kvstash-conf.") as tmp:
        sock = os.path.join(tmp, "k.sock")
        conf = os.path.join(tmp, "kvstashd.conf")
        with open(conf, "w") as f:
            f.write("# test\n[kvstashd]\nsocket = %s\npool_mb = 24\nmax-seqs = 99\n"
                    "metrics = 127.0.0.1:0\nlog_level = warn\n" % sock)
        p = subprocess.run([KVSTASHD, "--config", conf, "--pool-mb", "12", "--print-config"],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        got = dict(re.findall(r"^(\w+) = (.*)$", p.stdout, re.M))
        assert got["socket"] == sock and got["pool_mb"] == "12" and got["max_seqs"] == "99" \
            and got["log_level"] == "warn" and got["metrics"] == "127.0.0.1:0" \
            and got["threads"] == "2" and got["drain_ms"] == "0", got
        # Every flag of --help is a key of --print-config.
        h = subprocess.run([KVSTASHD, "--help"], capture_output=True, text=True, timeout=30)
        flags = set(re.findall(r"^  --([a-z-]+)", h.stdout, re.M)) - {
            "config", "print-config", "version", "help"}
        assert {k.replace("-", "_") for k in flags} == set(got), (flags, got)
        # --print-config output reads back as the same configuration.
        back = os.path.join(tmp, "back.conf")
        with open(back, "w") as f:
            f.write(p.stdout)
        p2 = subprocess.run([KVSTASHD, "--config", back, "--print-config"], capture_output=True,
                            text=True, timeout=30)
        assert dict(re.findall(r"^(\w+) = (.*)$", p2.stdout, re.M)) == got
        # A real daemon from the file, one flag overriding it.
        d = Daemon(extra_args=["--config", conf, "--pool-mb", "12"])
        d.sock = sock
        d.args = [KVSTASHD, "--config", conf, "--pool-mb", "12", "--log-level", "info"]
        try:
            d.start()
            assert metrics_port(d) > 0
            w = WorkerProc(d, "conf", seed=1, tokens=8, hold=True, model="conf")
            w.wait_line("READY")
            (pool,) = d.stats().pools
            assert pool.bytes_total <= 12 << 20 and pool.bytes_total > 8 << 20, pool.bytes_total
            w.finish()
            d.stop()
        finally:
            d.kill()
            d.cleanup()
        bad = os.path.join(tmp, "bad.conf")
        for text, msg in (("[kvstashd]\npool_mb = lots\n", "bad.conf:2: pool-mb must be"),
                          ("[other]\nx = 1\n", "unknown section [other]"),
                          ("[kvstashd]\nbogus = 1\n", "unknown option 'bogus'")):
            with open(bad, "w") as f:
                f.write(text)
            p = subprocess.run([KVSTASHD, "--config", bad], capture_output=True, text=True,
                               timeout=30)
            assert p.returncode == 2 and msg in p.stderr, (p.returncode, p.stderr)
        p = subprocess.run([KVSTASHD, "--config", os.path.join(tmp, "none.conf")],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and "cannot open" in p.stderr, p.stderr


if __name__ == "__main__":
    sys.exit(run_tests("metrics", [
        check_scrape_parses_with_types,
        check_counters_move_as_test_workers_act,
        check_ring_steps_and_attention_mass_dropped,
        check_ops_files_match_the_metrics,
        check_http_paths,
        check_metrics_listen_loopback_only,
        check_not_serving_while_shutting_down,
        check_config_file_and_print_config,
    ], daemon_kwargs={"pool_mb": 32, "extra_args": ["--metrics", "127.0.0.1:0"]}))
