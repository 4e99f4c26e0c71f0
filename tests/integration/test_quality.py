"""A real model as a kvstash worker: the CI slice of the quality benchmark
(issue 5, acceptance 1, 2 and 4).

kvstash-llama runs stories260K (../shared/data) with its KV cache in the real
kvstashd, and again with a plain in-process KV array (--no-daemon):

* with `full` in fp32 pools, every per-token log-likelihood through the
  daemon equals the in-process (fp32) forward pass within 1e-5, and the
  bytes held are the in-process array's plus the partly filled blocks;
* fp16 pools (the default) give the full-cache perplexity of fp32 ones
  within 0.1%, in half the bytes;
* greedy generation from "Once upon a time" is the same text both ways;
* a policy whose budget covers the whole context gives exactly (bit for bit)
  the `full` result, for one-list and per-head policies;
* offloaded victims (victims=int8) count in the bytes held;
* INT4 / INT2 tiers score finitely in fewer bytes than INT8, and precision
  by importance (demote_keep) beats a wider window at no more bytes;
* the benchmark script (tests/quality/run.py) on a few stories and policies:
  every perplexity is finite, and it writes its CSV, Markdown and SVG.
"""
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

from kvstash_harness import Daemon, run_tests

BUILD = os.environ.get("KVSTASH_BUILD_DIR", "")
LLAMA = os.path.join(BUILD, "client", "llama", "kvstash-llama")
SHARED = os.environ.get("KVSTASH_SHARED_DIR", "")
DATA = os.path.join(SHARED, "data")
MODEL = os.path.join(DATA, "stories260K.bin")
TEXT = os.path.join(DATA, "tinystories_val_dev.txt")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = "3"


def llama(*args, timeout=240):
    cmd = [LLAMA, *args, "--model", MODEL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-2000:]}"
    return p


def score(ctx, tmp, name, *policy_args, daemon=True):
    """Per-token log-probabilities {(story, pos): lp} and the JSON summary."""
    path = os.path.join(tmp, name + ".tok")
    where = ["--socket", ctx.daemon.sock, *policy_args] if daemon else ["--no-daemon"]
    p = llama("score", "--text", TEXT, "--stories", STORIES, "--per-token", path, "--quiet",
              *where)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    lps = {}
    with open(path) as f:
        for line in f:
            story, pos, lp = line.split()
            lps[(int(story), int(pos))] = float(lp)
    return lps, summary


# stories260K: 5 layers, 4 KV heads of 8; a pool block holds 4 tokens.
LAYERS, KV_DIM, BLOCK_TOKENS = 5, 32, 4


def check_full_through_daemon_equals_plain_array(ctx):
    with tempfile.TemporaryDirectory() as tmp:
        ref, rs = score(ctx, tmp, "plain", daemon=False)
        got, gs = score(ctx, tmp, "full", "--policy", "full", "--kv-dtype", "fp32")
        assert rs["tokens"] == gs["tokens"] > 500, (rs, gs)
        assert ref.keys() == got.keys()
        worst = max(abs(ref[k] - got[k]) for k in ref)
        assert worst <= 1e-5, f"largest per-token log-likelihood difference {worst:g}"
        assert gs["evicted"] == 0 and gs["kv_dtype"] == "fp32" and rs["kv_dtype"] == "fp32"
        # Both are fp32 and "full" is the fp16 cache of every token: twice as
        # much. The daemon's pool holds whole blocks: at most one partly
        # filled block per layer more than the plain array, on average half.
        assert gs["kv_bytes_full_mean"] == rs["kv_bytes_full_mean"]
        assert rs["kv_bytes_mean"] == 2 * rs["kv_bytes_full_mean"], rs
        block = BLOCK_TOKENS * KV_DIM * 2 * 4
        slack = gs["kv_bytes_mean"] - rs["kv_bytes_mean"]
        assert 0.3 * LAYERS * block < slack < 0.7 * LAYERS * block, (slack, gs, rs)
        ctx.full = (got, gs)
        print(f"     {gs['tokens']} tokens, ppl {gs['ppl']:.4f}, max |diff| {worst:.2e}")


def check_fp16_pools_same_perplexity_as_fp32(ctx):
    """The default pools are fp16: the model's K and V are rounded to fp16 as
    they are written; the full-cache perplexity stays within 0.1% of fp32
    pools', and the bytes held are half."""
    assert hasattr(ctx, "full"), "needs the full run"
    _, f32 = ctx.full
    with tempfile.TemporaryDirectory() as tmp:
        got, f16 = score(ctx, tmp, "fp16", "--policy", "full")
    assert f16["kv_dtype"] == "fp16" and f16["tokens"] == f32["tokens"], (f16, f32)
    assert got != ctx.full[0], "fp16 pools scored exactly like fp32: nothing was rounded"
    rel = abs(f16["ppl"] - f32["ppl"]) / f32["ppl"]
    assert rel < 1e-3, f"fp16 ppl {f16['ppl']:.6f}, fp32 {f32['ppl']:.6f} ({rel:.2e} apart)"
    assert f16["kv_bytes_mean"] * 2 == f32["kv_bytes_mean"], (f16, f32)
    print(f"     fp16 ppl {f16['ppl']:.6f}, fp32 {f32['ppl']:.6f}, {rel:.1e} apart")


def check_greedy_generation_same_through_daemon(ctx):
    args = ["generate", "--prompt", "Once upon a time", "--steps", "80"]
    plain = llama(*args, "--no-daemon").stdout
    daemon = llama(*args, "--socket", ctx.daemon.sock, "--kv-dtype", "fp32").stdout
    assert plain.startswith("Once upon a time"), plain
    assert len(plain) > 200, plain
    assert plain == daemon, f"plain:\n{plain}\ndaemon:\n{daemon}"


def check_budget_covering_context_is_exactly_full(ctx):
    assert hasattr(ctx, "full"), "needs the full run"
    full, fs = ctx.full
    # stories260K's context is 512 tokens: these budgets never evict.
    with tempfile.TemporaryDirectory() as tmp:
        for policy, budget in (("h2o", 512), ("snapkv", 600), ("weightedkv", 512),
                               ("streaming", 520), ("tova", 512)):
            got, gs = score(ctx, tmp, policy, "--policy", policy, "--budget", str(budget),
                            "--kv-dtype", "fp32")
            assert gs["evicted"] == 0, (policy, gs)
            diff = [k for k in full if full[k] != got[k]]
            assert not diff, f"{policy}: {len(diff)} tokens differ from full, first {diff[0]}"
            assert gs["nll"] == fs["nll"], (policy, gs["nll"], fs["nll"])


def check_int8_tier_through_the_daemon(ctx):
    """--int8 on: kvstashd demotes all but the newest 8 tokens of each list to
    INT8 and the model reads them through the fused dequantising attention:
    the perplexity moves a little (the model sees other values), the bytes
    the cache holds drop. Counted as stored, an INT8 block's scales take half
    of a 4-token fp16 block here (8·H·d bytes), so it holds 4 tokens, no more
    than fp16: only bigger blocks (16 tokens: 28 INT8 tokens a block) and
    lists that evictions do not fragment save bytes (docs/quality/README.md
    "How bytes are counted")."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--policy", "full", "--block-tokens", "16", "--model-name", "stories260K-b16"]
        _, off = score(ctx, tmp, "off", *args)
        _, on = score(ctx, tmp, "on", *args, "--int8", "on")
        ctx.b16 = {"full": off, "int8": on}  # the runs the next checks compare with
        assert math.isfinite(on["ppl"]) and on["tokens"] == off["tokens"], (on, off)
        assert on["nll"] != off["nll"], "INT8 on scored exactly like off: nothing was demoted"
        assert abs(on["ppl"] - off["ppl"]) < 0.05 * off["ppl"], (on["ppl"], off["ppl"])
        assert on["kv_bytes_mean"] < 0.8 * off["kv_bytes_mean"], (on, off)


def check_int4_int2_tiers_through_the_daemon(ctx):
    """demote=int4 / int2 (issue 15, acceptance 2): kvstashd demotes all but
    the newest 8 tokens of each list into INT4 / INT2 groups and the model
    reads them through the fused attention: finite perplexities, close to
    the full cache's for INT4 and further for INT2 (measured on these 3
    stories: full 3.6526, INT8 +0.002%, INT4 -0.16%, INT2 +8.1%), and fewer
    bytes held than INT8's, INT2 fewer than INT4 (as stored, against an fp16
    cache of every token: full 104%, INT8 69%, INT4 59%, INT2 50%; the
    newest 8 tokens and those waiting for a whole block stay at full
    precision, which in short stories is much of the cache)."""
    assert hasattr(ctx, "b16"), "needs the INT8 check's runs"
    full, i8 = ctx.b16["full"], ctx.b16["int8"]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--policy", "full", "--block-tokens", "16", "--model-name", "stories260K-b16"]
        runs = {name: score(ctx, tmp, name, *args, "--demote", name)[1]
                for name in ("int4", "int2")}
        ctx.b16.update(runs)
        for name, r in runs.items():
            assert math.isfinite(r["ppl"]) and r["tokens"] == full["tokens"], (name, r, full)
            assert r["nll"] != full["nll"], f"{name} scored exactly like full: nothing demoted"
            assert r["demote"] == name, r
        assert runs["int2"]["kv_bytes_mean"] < runs["int4"]["kv_bytes_mean"] < \
            0.9 * i8["kv_bytes_mean"], (runs, i8)
        assert abs(runs["int4"]["ppl"] - full["ppl"]) < 0.02 * full["ppl"], (runs, full)
        assert abs(runs["int2"]["ppl"] - full["ppl"]) < 0.2 * full["ppl"], (runs, full)


def check_quant_group_is_a_pool_parameter(ctx):
    """kvstashd --quant-group 8: INT2 groups of 8 tokens (keys) and 8 channels
    (values) cost more bytes in scales and lose less than the default 32's
    (measured: ppl 3.6584 against 3.9477, 55% of the bytes against 50%); the
    worker reads the group size from the tables."""
    assert "int2" in getattr(ctx, "b16", {}), "needs the INT2 run at the default group"
    g32 = ctx.b16["int2"]
    d = Daemon(pool_mb=64, extra_args=["--quant-group", "8"])
    d.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = ["--policy", "full", "--block-tokens", "16", "--model-name", "stories260K-b16",
                    "--demote", "int2"]
            _, g8 = score(SimpleNamespace(daemon=d), tmp, "g8", *args)
    finally:
        d.stop()
    assert math.isfinite(g8["ppl"]) and g8["tokens"] == g32["tokens"], (g8, g32)
    assert g8["ppl"] < g32["ppl"] and g8["kv_bytes_mean"] > g32["kv_bytes_mean"], (g8, g32)


def check_precision_by_importance(ctx):
    """demote_keep (issue 15 item 3; policies/storage.h): the worker reports
    its attention and kvstashd keeps the most attended share of the
    demotable tokens at full precision. With INT2 and a share of 0.1, it
    loses less than keeping the newest tokens instead (a wider window) in
    no more bytes (measured: ppl 3.7620 at 53.5% against 3.8116 at 54.3%;
    INT2 alone 3.9477 at 49.6%); a per-head policy (adakv, whose budget
    covers the context) grades by its last_attn rows the same way."""
    assert "int2" in getattr(ctx, "b16", {}), "needs the INT2 run"
    g0 = ctx.b16["int2"]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--block-tokens", "16", "--model-name", "stories260K-b16", "--demote", "int2"]
        _, keep = score(ctx, tmp, "keep", "--policy", "full", *args, "--set", "demote_keep=0.1")
        _, wide = score(ctx, tmp, "wide", "--policy", "full", *args, "--set", "int8_window=24")
        assert keep["ppl"] < wide["ppl"] and keep["kv_bytes_mean"] <= wide["kv_bytes_mean"], \
            (keep, wide)
        assert keep["ppl"] < g0["ppl"] and keep["kv_bytes_mean"] > g0["kv_bytes_mean"], (keep, g0)
        head = ["--policy", "adakv", "--budget", "512", *args]
        _, h0 = score(ctx, tmp, "h0", *head)
        _, hk = score(ctx, tmp, "hk", *head, "--set", "demote_keep=0.25")
        assert h0["evicted"] == 0 and hk["evicted"] == 0, (h0, hk)
        assert hk["ppl"] < h0["ppl"] and hk["kv_bytes_mean"] > h0["kv_bytes_mean"], (hk, h0)


def check_reviver_attends_over_its_sketch(ctx):
    """reviver's sketched tokens live only in kvstashd's count-sketch; the
    worker revives them each step to attend over the whole sequence."""
    with tempfile.TemporaryDirectory() as tmp:
        _, rv = score(ctx, tmp, "reviver", "--policy", "reviver", "--budget", "32")
        _, full = score(ctx, tmp, "full", "--policy", "full")
        assert math.isfinite(rv["ppl"]) and rv["tokens"] == full["tokens"], (rv, full)
        assert rv["nll"] != full["nll"], "reviver scored exactly like full: nothing was sketched"
        assert rv["kv_bytes_mean"] < full["kv_bytes_mean"], (rv, full)


def check_offloaded_victims_are_counted(ctx):
    """victims=int8 keeps every token h2o evicts in INT8 blocks, out of the
    attention: the model scores exactly as when they are dropped, but the
    bytes held (the daemon's count: the table does not show victims) grow
    past what the held tokens take."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--policy", "h2o", "--budget", "32"]
        drop_lp, drop = score(ctx, tmp, "drop", *args)
        keep_lp, keep = score(ctx, tmp, "keep", *args, "--set", "victims=int8")
    assert keep_lp == drop_lp and keep["evicted"] == drop["evicted"] > 0, (keep, drop)
    assert keep["kv_bytes_mean"] > 2 * drop["kv_bytes_mean"], (keep, drop)


def check_benchmark_slice_perplexities_finite(ctx):
    policies = ["streaming", "h2o", "snapkv", "criticalkv", "confkv", "weightedkv"]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(REPO, "tests", "quality", "run.py"), "--build", BUILD,
               "--model", MODEL, "--text", TEXT, "--stories", "2", "--policies",
               ",".join(policies), "--budgets", "16,64", "--int8", "off", "--jobs", "2",
               "--out", out, "--name", "slice", "--pool-mb", "64"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                           stdin=subprocess.DEVNULL)
        assert p.returncode == 0, f"run.py: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        with open(os.path.join(out, "slice.csv")) as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 1 + 2 * len(policies), rows
        for r in rows:
            assert r["status"] == "ok", r
            ppl = float(r["ppl"])
            assert math.isfinite(ppl) and ppl > 1, r
            if r["policy"] != "full":
                assert 0 < float(r["kv_fraction"]) < 1, r
        with open(os.path.join(out, "slice.md")) as f:
            md = f.read()
        assert "| streaming |" in md and "tests/quality/run.py" in md, md
        assert "## Pareto" in md and "| ≤ 50% |" in md, md
        with open(os.path.join(out, "slice.svg")) as f:
            svg = f.read()
        assert svg.startswith("<svg") and svg.count("<polyline") == len(policies), svg[:300]


def main():
    for path in (LLAMA, MODEL, TEXT):
        if not os.path.exists(path):
            print(f"test_quality: {path} is missing")
            print("test_quality: 0 passed, 1 failed")
            return 1
    return run_tests("test_quality", [
        check_full_through_daemon_equals_plain_array,
        check_fp16_pools_same_perplexity_as_fp32,
        check_greedy_generation_same_through_daemon,
        check_budget_covering_context_is_exactly_full,
        check_int8_tier_through_the_daemon,
        check_int4_int2_tiers_through_the_daemon,
        check_quant_group_is_a_pool_parameter,
        check_precision_by_importance,
        check_reviver_attends_over_its_sketch,
        check_offloaded_victims_are_counted,
        check_benchmark_slice_perplexities_finite,
    ], daemon_kwargs={"pool_mb": 64, "log_level": "info"}, time_limit=570)


if __name__ == "__main__":
    sys.exit(main())
