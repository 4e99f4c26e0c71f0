#!/usr/bin/env python3
"""`kvstash replay` end to end: the POLICIES.md §2.10 vectors T-OV1 and T-OV2
as ov_block traces, the generic operations, and every bad-trace case.

Runs `kvstash replay` ($KVSTASH_CLI, or $KVSTASH_BUILD_DIR/client/kvstash) (or
$KVSTASH_REPLAY). Outputs are compared exactly, after JSON parsing; the
rotation coefficients are compared with Python's own cos/sin to 1e-12.
Prints "N passed, M failed" and exits non-zero on any failure.
"""
import json
import math
import os
import subprocess
import sys

BUILD = os.environ.get("KVSTASH_BUILD_DIR", "")
# `kvstash replay`: the operator CLI, as users run it.
CLI = os.environ.get("KVSTASH_CLI") or os.path.join(BUILD, "client", "kvstash")
BIN = [CLI, "replay"]

TOV1 = [5, 5, 0.4, 0.4, 0.9, 0.8, 0.3, 0.3, 0.6, 0.5, 0.7]
TOV1_ARGS = ["--block-tokens", "2", "--head-dim", "4",
             "--set", "start_size=2", "--set", "recent_size=2", "--set", "max_cache_size=8",
             "--set", "max_pool_window=1", "--set", "snapkv_window=0"]
TOV2 = [7, 7, 0.9, 0.1, 0.2, 0.75, 0.3, 0.35, 0.05, 0.62, 0.4, 0.15, 1, 1, 1]
TOV2_ARGS = ["--block-tokens", "2",
             "--set", "start_size=2", "--set", "recent_size=2", "--set", "max_cache_size=6",
             "--set", "max_pool_window=1", "--set", "snapkv_window=0",
             "--set", "aggregation=sum"]

passed = 0
failed = 0


def replay(policy, args, lines):
    trace = "".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines)
    p = subprocess.run(BIN + ["--policy", policy] + args, input=trace, capture_output=True,
                       text=True, timeout=60)
    return p.returncode, [json.loads(l) for l in p.stdout.splitlines() if l.strip()], p.stderr


def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name}: {detail}")


def expect_outputs(name, policy, args, lines, want, stderr_has=None):
    rc, out, err = replay(policy, args, lines)
    ok = rc == 0 and out == want and (stderr_has is None or stderr_has in err)
    check(name, ok, f"rc={rc} out={out} want={want} stderr={err!r}")
    return out


def expect_error(name, policy, args, lines, code, *needles):
    rc, out, err = replay(policy, args, lines)
    ok = rc == code and all(n in err for n in needles)
    check(name, ok, f"rc={rc} (want {code}) stderr={err!r} (want {needles})")


def rows(delta, d=4, theta=10000.0):
    s, c = [], []
    for j in range(d // 2):
        a = delta * theta ** (-2.0 * j / d)
        s.append(-math.sin(a))
        c.append(math.cos(a))
    return s, c


def test_tov1_norm_sum():
    out = expect_outputs(
        "T-OV1 NORM_SUM: counters, evict block 1, remaining scores",
        "ov_block", TOV1_ARGS,
        [{"scores": [TOV1], "snapkv": 0}, {"state": True}, {"evict": True}, {"state": True},
         {"held": True}],
        [{"scores": [TOV1[2:]], "counters": [[9, 8, 7, 6, 5, 4, 3, 2, 1]]},
         {"evicted_blocks": [[1]]},
         {"scores": [[0.9, 0.8, 0.3, 0.3, 0.6, 0.5, 0.7]], "counters": [[7, 6, 5, 4, 3, 2, 1]]},
         {"held": [[0, 1, 4, 5, 6, 7, 8, 9, 10]]}])
    del out


def test_tov1_rotation():
    rc, out, err = replay("ov_block", TOV1_ARGS,
                          [{"scores": [TOV1]}, {"evict": True},
                           {"rotation": {"evicted": [1], "blocks_before": 6}}])
    ok = rc == 0 and len(out) == 2 and out[0] == {"evicted_blocks": [[1]]}
    if ok:
        rot = out[1]["rotated"]
        ok = [(r["block"], r["delta"]) for r in rot] == [(1, 2), (2, 2), (3, 2), (4, 2)]
        s, c = rows(2)
        for r in rot:
            ok = ok and len(r["sin"]) == 2 and len(r["cos"]) == 2
            ok = ok and all(abs(a - b) <= 1e-12 for a, b in zip(r["sin"] + r["cos"], s + c))
    check("T-OV1 rotation list (new 1..4, delta 2) with -sin/cos rows", ok,
          f"rc={rc} out={out} stderr={err!r}")


def test_tov1_sum_two_layers():
    other = [5, 5, 0.1, 0.1, 0.9, 0.8, 0.3, 0.3, 0.6, 0.5, 0.7]
    expect_outputs(
        "T-OV1 SUM: evict block 3; layers evict by their own scores",
        "ov_block", TOV1_ARGS + ["--set", "aggregation=sum", "--layers", "2"],
        [{"scores": [TOV1, other]}, {"evict": True}, {"state": True}],
        [{"evicted_blocks": [[3], [1]]},
         {"scores": [[0.4, 0.4, 0.9, 0.8, 0.6, 0.5, 0.7], [0.9, 0.8, 0.3, 0.3, 0.6, 0.5, 0.7]],
          "counters": [[], []]}])


def test_tov1_generic_step():
    expect_outputs(
        "T-OV1 through the generic step (the daemon's path)",
        "ov_block", TOV1_ARGS,
        [{"step": {"new_tokens": 11, "prefill": False, "score": [TOV1], "score_queries": 11}},
         {"held": True}],
        [{"step": 1, "evicted": [[2, 3]], "tiers": [], "merges": []},
         {"held": [[0, 1, 4, 5, 6, 7, 8, 9, 10]]}])
    expect_outputs(
        "generic step with apply_rotation reports rerotate_keys",
        "ov_block", TOV1_ARGS + ["--set", "apply_rotation=1"],
        [{"step": {"new_tokens": 11, "score": [TOV1], "score_queries": 11}}],
        [{"step": 1, "evicted": [[2, 3]], "tiers": [], "merges": [], "rerotate_keys": True}])
    expect_outputs(
        "generic prefill step never evicts",
        "ov_block", TOV1_ARGS,
        [{"step": {"new_tokens": 11, "prefill": True, "score": [TOV1], "score_queries": 11}}],
        [{"step": 1, "evicted": [[]], "tiers": [], "merges": []}])


def test_tov2_kvcrush():
    expect_outputs(
        "T-OV2 KVCrush(2, MEAN): evicted absolute blocks {3, 5}",
        "ov_block", TOV2_ARGS + ["--set", "kvcrush_budget=2", "--set", "kvcrush_anchor=mean"],
        [{"scores": [TOV2]}, {"evict": True}, {"state": True}, {"held": True}],
        [{"evicted_blocks": [[3, 5]]},
         {"scores": [[0.9, 0.1, 0.2, 0.75, 0.05, 0.62, 1, 1, 1]], "counters": [[]]},
         {"held": [[0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 14]]}])
    expect_outputs(
        "T-OV2 without KVCrush evicts all four victims",
        "ov_block", TOV2_ARGS,
        [{"scores": [TOV2]}, {"evict": True}],
        [{"evicted_blocks": [[2, 3, 4, 5]]}])


def test_snapkv_window():
    args = TOV1_ARGS[:-2] + ["--set", "snapkv_window=8"]
    v = [1.0 + i for i in range(14)]
    expect_outputs(
        "snapkv 0 while the window is open is ignored (and said on stderr)",
        "ov_block", args,
        [{"scores": [v[:10]], "snapkv": 0}, {"state": True}, {"held": True},
         {"scores": [v], "snapkv": 3}, {"state": True}],
        [{"scores": [[]], "counters": [[]]},
         {"held": [list(range(10))]},
         {"scores": [v[2:]], "counters": [[3] * 9 + [3, 2, 1]]}],
        stderr_has="line 1: note: registration ignored: snapkv 0")
    expect_outputs(
        "in-window growth and normal growth counters",
        "ov_block", args,
        [{"scores": [[1] * 8], "snapkv": 3}, {"scores": [[1] * 12], "snapkv": 2},
         {"state": True}, {"scores": [[1] * 14], "snapkv": 3}, {"state": True}],
        [{"scores": [[2] * 6 + [1] * 4], "counters": [[5] * 6 + [4, 3, 2, 1]]},
         {"scores": [[3] * 6 + [2] * 4 + [1] * 2],
          "counters": [[7] * 6 + [6, 5, 4, 3, 2, 1]]}])


def test_maxpool_default():
    args = TOV1_ARGS[:-4] + ["--set", "snapkv_window=0"]  # default max_pool_window 7
    expect_outputs(
        "forward max-pool, window 7, shrinking tail",
        "ov_block", args,
        [{"scores": [[0, 0, 1, 0, 0, 0, 0, 0, 0, 2, 0, 0]]}, {"state": True}],
        [{"scores": [[1, 2, 2, 2, 2, 2, 2, 2, 0, 0]], "counters": [[10, 9, 8, 7, 6, 5, 4, 3, 2, 1]]}])


def test_generic_ops():
    expect_outputs(
        "generic append/step/held/state on streaming",
        "streaming", ["--set", "n_sink=2", "--set", "window=4"],
        [{"append": 6}, {"step": {"new_tokens": 4}}, {"held": True}, {"state": True},
         {"step": {"new_tokens": 1, "prefill": False}}],
        [{"step": 1, "evicted": [[2, 3, 4, 5]], "tiers": [], "merges": []},
         {"held": [[0, 1, 6, 7, 8, 9]]},
         {"state": [None]},
         {"step": 2, "evicted": [[6]], "tiers": [], "merges": []}])
    expect_outputs(
        "generic ops with two layers on full",
        "full", ["--layers", "2"],
        [{"append": 3}, {"step": {"new_tokens": 0}}, {"held": True}],
        [{"step": 1, "evicted": [[], []], "tiers": [], "merges": []},
         {"held": [[0, 1, 2], [0, 1, 2]]}])
    rc, out, err = replay("ov_block", [], [{"state": True}])
    check("ov_block state of an empty sequence", rc == 0 and out == [{"scores": [[]],
                                                                     "counters": [[]]}],
          f"rc={rc} out={out} err={err!r}")


def test_bad_traces():
    ov = TOV1_ARGS
    expect_error("invalid JSON names the line", "ov_block", ov,
                 [{"state": True}, '{"evict": tru'], 1, "line 2", "invalid JSON")
    expect_error("unknown operation names the line and the operation", "ov_block", ov,
                 [{"state": True}, {"state": True}, {"bogus": 1}], 1, "line 3",
                 "unknown operation 'bogus'")
    expect_error("registration shorter than the tokens already tracked", "ov_block", ov,
                 [{"scores": [TOV1]}, "", {"scores": [TOV1[:10]]}], 1, "line 3",
                 "shorter than the 11 tokens the sequence already holds")
    expect_error("registration shorter after an eviction", "ov_block", ov,
                 [{"scores": [TOV1]}, {"evict": True}, {"scores": [TOV1[:8]]}], 1, "line 3",
                 "shorter than the 9 tokens")
    expect_error("rotation without blocks_before", "ov_block", ov,
                 [{"rotation": {"evicted": [1]}}], 1, "line 1", "blocks_before is missing")
    expect_error("rotation: evicted block >= blocks_before", "ov_block", ov,
                 [{"state": True}, {"rotation": {"evicted": [2, 6], "blocks_before": 6}}], 1,
                 "line 2", "evicted block 6 is outside the 6 blocks")
    expect_error("SnapKV window overfilled", "ov_block", TOV1_ARGS[:-2] + ["--set", "snapkv_window=4"],
                 [{"scores": [TOV1], "snapkv": 3}, {"scores": [TOV1], "snapkv": 2}], 1,
                 "line 2", "snapkv_window")
    expect_error("wrong number of layer vectors", "ov_block", ov + ["--layers", "2"],
                 [{"scores": [TOV1]}], 1, "line 1", "2 layer vectors")
    expect_error("layer vectors of different lengths", "ov_block", ov + ["--layers", "2"],
                 [{"scores": [TOV1, TOV1[:9]]}], 1, "line 1", "layer 1 has 9 values")
    expect_error("non-number score", "ov_block", ov,
                 [{"scores": [[1, 2, "x"]]}], 1, "line 1", "value 2 is not a number")
    expect_error("unknown field", "ov_block", ov,
                 [{"scores": [TOV1], "snap": 1}], 1, "line 1", "unknown field 'snap'")
    expect_error("evict must be true", "ov_block", ov,
                 [{"evict": False}], 1, "line 1", "must be true")
    expect_error("a line that is not an object", "ov_block", ov,
                 [[1, 2]], 1, "line 1", "JSON object")
    expect_error("empty object", "ov_block", ov, [{}], 1, "line 1", "empty object")
    expect_error("ov_block operation on another policy", "streaming", [],
                 [{"evict": True}], 1, "line 1", "only for policy ov_block")
    expect_error("step score of the wrong length", "ov_block", ov,
                 [{"step": {"new_tokens": 3, "score": [[1, 2]]}}], 1, "line 1",
                 "score[0] has 2 values")
    expect_error("step without the score ov_block needs", "ov_block", ov,
                 [{"step": {"new_tokens": 3}}], 1, "line 1", "layer 0", "score")
    expect_error("step with an unknown field", "streaming", [],
                 [{"step": {"new_token": 3}}], 1, "line 1", "unknown field 'new_token'")
    expect_error("negative append", "full", [], [{"append": -1}], 1, "line 1", "append")
    # Invalid configurations name the parameter.
    expect_error("start_size not a multiple of the block size", "ov_block",
                 ["--block-tokens", "2", "--set", "start_size=3", "--set", "max_cache_size=8"],
                 [], 1, "start_size")
    expect_error("max_cache_size <= start + recent", "ov_block",
                 ["--block-tokens", "2", "--set", "start_size=2", "--set", "recent_size=2",
                  "--set", "max_cache_size=4"], [], 1, "max_cache_size")
    expect_error("block_size differs from --block-tokens", "ov_block",
                 ["--block-tokens", "2", "--set", "block_size=4"], [], 1, "block_size")
    expect_error("start_size 0", "ov_block", ["--set", "start_size=0"], [], 1, "start_size")
    expect_error("bad aggregation", "ov_block", ["--set", "aggregation=mean"], [], 1,
                 "aggregation")
    expect_error("bad anchor", "ov_block", ["--set", "kvcrush_anchor=x"], [], 1,
                 "kvcrush_anchor")
    expect_error("unknown parameter", "ov_block", ["--set", "window=3"], [], 1,
                 "unknown parameter 'window'")
    expect_error("zero layers", "ov_block", ["--layers", "0"], [], 1, "--layers", "zero layers")
    expect_error("unknown policy", "nope", [], [], 1, "unknown policy 'nope'")
    expect_error("q-heads not a multiple of kv-heads", "full", ["--q-heads", "3", "--kv-heads",
                                                                "2"], [], 1, "--q-heads")
    # Usage errors exit 2.
    rc = subprocess.run(BIN, input="", capture_output=True, text=True).returncode
    check("missing --policy is a usage error", rc == 2, f"rc={rc}")
    expect_error("non-integer --layers", "full", ["--layers", "x"], [], 2, "--layers")
    expect_error("unknown option", "full", ["--frob", "1"], [], 2, "unknown option '--frob'")
    expect_error("--set without =", "full", ["--set", "n_sink"], [], 2, "key=value")
    expect_error("option without a value", "full", ["--layers"], [], 2, "needs a value")


def test_outputs_before_an_error_survive():
    rc, out, err = replay("ov_block", TOV1_ARGS, [{"scores": [TOV1]}, {"evict": True}, "{"])
    check("answers before a bad line are written", rc == 1 and out == [{"evicted_blocks": [[1]]}]
          and "line 3" in err, f"rc={rc} out={out} err={err!r}")


def test_help():
    p = subprocess.run(BIN + ["--help"], capture_output=True, text=True)
    check("--help prints usage and exits 0", p.returncode == 0 and "usage: kvstash replay"
          in p.stdout, f"rc={p.returncode} out={p.stdout!r}")


def main():
    if not os.access(CLI, os.X_OK):
        print(f"kvstash not found at {CLI} (set KVSTASH_CLI or KVSTASH_BUILD_DIR)")
        print("0 passed, 1 failed")
        return 1
    for t in (test_tov1_norm_sum, test_tov1_rotation, test_tov1_sum_two_layers,
              test_tov1_generic_step, test_tov2_kvcrush, test_snapkv_window,
              test_maxpool_default, test_generic_ops, test_bad_traces,
              test_outputs_before_an_error_survive, test_help):
        t()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
