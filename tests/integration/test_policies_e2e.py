"""Every registered policy, end to end (issue 3, acceptance 2 and 3).

For each policy a real worker process (kvs_policy_worker, libkvstash) runs a
prefill and decode steps against the real kvstashd, reporting seeded random
attention statistics through the per-step shared-memory ring and checking
after every step that each held token's K/V is what it wrote for that
position. It records the exact statistics as a `kvstash replay` trace. Then:

* the daemon's final tables equal `kvstash replay` on the same trace;
* conformance, on the replay after every step: the policy's budget is never
  exceeded, its protected tokens are never evicted, and the same trace gives
  the same output twice;
* memory is actually freed: the sequence's tables use fewer blocks than the
  full cache would, and no more than the kept tokens need plus a bounded
  overhead (contiguous compaction).
"""
import json
import os
import subprocess
import sys

from kvstash_harness import run_tests
from test_metrics import Scrape, metrics_port

GEOM = {"layers": 2, "q-heads": 4, "kv-heads": 2, "head-dim": 8, "block-tokens": 4}
PREFILL, STEPS = 24, 40
TOTAL = PREFILL + STEPS


def lists_of(held):
    """[(layer, head, positions)] from replay's held format."""
    out = []
    for l, layer in enumerate(held):
        if layer and isinstance(layer[0], list):
            out += [(l, h, ps) for h, ps in enumerate(layer)]
        else:
            out.append((l, 0, layer))
    return out


def last_n(n):
    return lambda t: set(range(max(0, t - n), t))


def first_n(n):
    return lambda t: set(range(min(n, t)))


def union(*fs):
    return lambda t: set().union(*(f(t) for f in fs))


# policy: (params, arrays, worker flags, per-list bound after a decode step
# (None: no bound), protected positions at total length t, bound applies to
# the sum over a layer's lists instead of each list)
POLICIES = {
    "full": ([], "", [], None, lambda t: set(range(t)), False),
    "streaming": (["n_sink=4", "window=8"], "", [], 12, union(first_n(4), last_n(8)), False),
    "h2o": (["budget=16"], "score", [], 16, last_n(8), False),
    "tova": (["budget=16"], "last", [], 16, last_n(1), False),
    "ov_block": (["start_size=4", "recent_size=8", "max_cache_size=24", "snapkv_window=0",
                  "max_pool_window=1"], "score", [], 24 + 4 - 1,
                 union(first_n(4), last_n(8)), False),
    "snapkv": (["budget=16", "window=4", "kernel=3"], "window", [], 16, lambda t: set(), False),
    "adakv": (["budget=16", "window=4", "kernel=3"], "window", [], 32, lambda t: set(), True),
    "criticalkv": (["budget=16", "window=4", "kernel=3"], "window,vnorm", [], 16,
                   lambda t: set(), False),
    "criticalkv_ada": (["budget=16", "window=4", "kernel=3"], "window,vnorm", [], 32,
                       lambda t: set(), True),
    "confkv": (["budget_tight=12", "budget_loose=20", "protect=4", "fp16_window=6"],
               "last,conf", [], 20, last_n(4), False),
    "weightedkv": (["cache_size=16", "n_init=2", "n_recent=4"], "last",
                   ["--no-verify-values"], 16, union(first_n(2), last_n(4)), False),
    "reviver": (["budget=24", "rows=3"], "score", [], None, lambda t: set(range(t)), False),
}


def geometry_args(prefix="--"):
    return [a for k, v in GEOM.items() for a in (prefix + k, str(v))]


def run_worker(ctx, policy, params, arrays, flags, trace):
    binary = os.environ["KVSTASH_POLICY_WORKER"]
    args = [binary, "--socket", ctx.daemon.sock, "--model", "e2e", "--policy", policy,
            "--prefill", str(PREFILL), "--steps", str(STEPS), "--seed", "7", "--trace", trace,
            *geometry_args(), *flags]
    if arrays:
        args += ["--arrays", arrays]
    for p in params:
        args += ["--set", p]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (f"{policy}: worker exit {p.returncode}: {p.stdout[-400:]!r} "
                               f"{p.stderr[-400:]!r}")
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-2])["held"], json.loads(lines[-1])


def replay(policy, params, trace_text):
    cli = os.environ["KVSTASH_CLI"]
    args = [cli, "replay", "--policy", policy, *geometry_args()]
    for p in params:
        args += ["--set", p]
    p = subprocess.run(args, input=trace_text, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{policy}: replay exit {p.returncode}: {p.stderr[-600:]}"
    return p.stdout


def check_policy(ctx, policy):
    params, arrays, flags, bound, protected, bound_per_layer = POLICIES[policy]
    trace = os.path.join(ctx.daemon.dir, f"{policy}.jsonl")
    held, result = run_worker(ctx, policy, params, arrays, flags, trace)
    with open(trace) as f:
        steps = f.read().splitlines()
    assert len(steps) == 1 + STEPS, f"{policy}: trace has {len(steps)} steps"

    # Replay with a held query after every step.
    text = "".join(line + "\n" + '{"held": true}\n' for line in steps)
    out = replay(policy, params, text)
    assert out == replay(policy, params, text), f"{policy}: same trace, different output"
    outputs = [json.loads(line) for line in out.splitlines()]
    helds = [o["held"] for o in outputs if "held" in o]
    assert len(helds) == 1 + STEPS, f"{policy}: {len(helds)} held answers"
    assert helds[-1] == held, (f"{policy}: the daemon holds {json.dumps(held)[:300]} but replay "
                               f"holds {json.dumps(helds[-1])[:300]}")

    # Conformance after every step.
    for i, h in enumerate(helds):
        t = PREFILL + i
        per_layer = {}
        for layer, head, ps in lists_of(h):
            assert ps == sorted(set(ps)) and all(0 <= p < t for p in ps), (policy, i, ps)
            missing = protected(t) - set(ps)
            assert not missing, f"{policy}: step {i} evicted protected {sorted(missing)}"
            per_layer[layer] = per_layer.get(layer, 0) + len(ps)
            if bound is not None and i > 0 and not bound_per_layer:
                assert len(ps) <= bound, f"{policy}: step {i} list holds {len(ps)} > {bound}"
        if bound is not None and i > 0 and bound_per_layer:
            assert max(per_layer.values()) <= bound, (policy, i, per_layer)

    # Memory: blocks the final tables use.
    lists = lists_of(held)
    kept = sum(len(ps) for _, _, ps in lists)
    slots = result["block_slots"]
    need = sum(-(-len(ps) // slots) for _, _, ps in lists)
    full_blocks = len(lists) * -(-TOTAL // slots)
    assert result["blocks"] <= need + 2 * len(lists), (policy, result, need)
    if kept < TOTAL * len(lists) // 2:
        assert result["blocks"] < full_blocks, f"{policy}: no memory freed: {result}"
    print(f"     {policy}: {kept} tokens kept in {result['blocks']} blocks "
          f"(full cache: {full_blocks}); {result['checked']} token rows verified", flush=True)


def make_check(policy):
    def check(ctx):
        check_policy(ctx, policy)
    check.__name__ = f"check_{policy}_daemon_matches_replay"
    return check


def check_ov_block_rerotates_shifted_keys(ctx):
    """apply_rotation=1: the worker writes keys with RoPE at their position
    and, after each step, expects every kept key re-rotated by how far its
    index moved (OpenVINO §2.8); a daemon that does not rotate fails."""
    params = POLICIES["ov_block"][0] + ["apply_rotation=1"]
    trace = os.path.join(ctx.daemon.dir, "ov_block_rotation.jsonl")
    held, result = run_worker(ctx, "ov_block", params, "score", ["--rope"], trace)
    with open(trace) as f:
        text = f.read() + '{"held": true}\n'
    out = replay("ov_block", params, text).splitlines()
    assert json.loads(out[-1])["held"] == held
    assert any('"rerotate_keys":true' in line for line in out), "no step asked for rotation"
    print(f"     ov_block with rotation: {result['checked']} rows verified", flush=True)


def check_weightedkv_merges_into_int8_tokens(ctx):
    """int8=on under weightedkv: merges into (and from) tokens already stored
    INT8 bring them back to full precision first (an INT8 block is written
    once) instead of being skipped; the worker reads every key back within
    the bound of the quantisations it saw."""
    params = ["cache_size=40", "n_init=2", "n_recent=4", "int8=on", "int8_window=4"]
    scrape = Scrape(metrics_port(ctx.daemon))
    back = scrape.get("kvstash_tier_moves_total", policy="weightedkv", to="full")
    trace = os.path.join(ctx.daemon.dir, "weightedkv_int8.jsonl")
    _, result = run_worker(ctx, "weightedkv", params, "last", ["--no-verify-values"], trace)
    assert result["int8_checked"] > 0, result
    after = Scrape(metrics_port(ctx.daemon))
    assert after.get("kvstash_tier_moves_total", policy="weightedkv", to="int8") > 0, after.text
    # weightedkv never decides an INT8 token back to full precision: these
    # moves are the merges'.
    assert after.get("kvstash_tier_moves_total", policy="weightedkv", to="full") > back, \
        after.text
    print(f"     weightedkv with int8: {result['int8_checked']} INT8 rows verified", flush=True)


def check_every_registered_policy_is_covered(ctx):
    cli = os.environ["KVSTASH_CLI"]
    p = subprocess.run([cli, "--socket", ctx.daemon.sock, "policy", "list", "--json"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    listed = json.loads(p.stdout)
    names = {x if isinstance(x, str) else x.get("name") for x in
             (listed if isinstance(listed, list) else listed.get("policies", []))}
    assert names, f"no policies listed: {p.stdout[:200]}"
    assert names <= set(POLICIES), f"policies without an end-to-end test: {names - set(POLICIES)}"


if __name__ == "__main__":
    checks = [make_check(p) for p in POLICIES] + [check_ov_block_rerotates_shifted_keys,
                                                  check_weightedkv_merges_into_int8_tokens,
                                                  check_every_registered_policy_is_covered]
    sys.exit(run_tests("policies_e2e", checks,
                       daemon_kwargs={"pool_mb": 32,
                                      "extra_args": ["--metrics", "127.0.0.1:0"]}))
