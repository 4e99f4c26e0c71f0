#!/usr/bin/env bash
# tests/bench/run.sh - build (if needed) and run the benchmarks against the
# real daemon: bench_rpc (control plane, ring, writes), then bench_tiers (tier
# moves: Revive, demotion, offload), then bench_python_step.py (a decode step
# through the Python package vs from C), then bench_policy_decision (one policy
# decision at Llama-3-8B shape vs PyTorch and the read bound; it exits 1 if the
# kept sets differ), then bench_step_context (a decode step's cost as the
# context grows, 32 layers; BENCH_STEP_CONTEXT_ARGS adds its options, e.g.
# "--head-dim 64" where memory is short), then bench_many_workers (1-8 worker
# processes stepping, with and without one reviving and demoting, then with
# and without one whose prompts decide), then
# bench_remote (the remote tier on a Redis Cluster it starts: store bandwidth
# against raw hiredis pipelines, sequence export/import against memcpy and our
# client; needs redis-server and redis-cli). Usage: tests/bench/run.sh [--quick] [--pin CPU]
# (--pin applies to bench_rpc and bench_python_step). BUILD_DIR picks the build tree (default:
# build; configured if missing). Exits non-zero if any benchmark fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build=${BUILD_DIR:-build}

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build"
fi
cmake --build "$build" -j"$(nproc)" --target bench_rpc bench_tiers bench_policy_decision \
    bench_step_context bench_many_workers bench_remote kvstashd

tiers_args=()
for a in "$@"; do
    if [ "$a" = --quick ]; then
        tiers_args+=(--quick)
    fi
done

rc=0
"$build/tests/bench/bench_rpc" "$@" "$build/daemon/kvstashd" || rc=1
echo
"$build/tests/bench/bench_tiers" "${tiers_args[@]}" "$build/daemon/kvstashd" || rc=1
echo
/usr/bin/python3 tests/bench/bench_python_step.py "$@" --build "$build" || rc=1
echo
"$build/tests/bench/bench_policy_decision" "${tiers_args[@]}" || rc=1
echo
# shellcheck disable=SC2086 # word splitting of the options is wanted
"$build/tests/bench/bench_step_context" "${tiers_args[@]}" ${BENCH_STEP_CONTEXT_ARGS:-} \
    "$build/daemon/kvstashd" || rc=1
echo
"$build/tests/bench/bench_many_workers" "${tiers_args[@]}" "$build/daemon/kvstashd" || rc=1
echo
# A prompt's decision beside the workers; 20,000 steps a worker outlast many of them.
decide_steps=(--steps 20000)
[ ${#tiers_args[@]} -gt 0 ] && decide_steps=()
"$build/tests/bench/bench_many_workers" "${tiers_args[@]}" "${decide_steps[@]}" --mover decide \
    "$build/daemon/kvstashd" || rc=1
echo
"$build/tests/bench/bench_remote" "${tiers_args[@]}" "$build/daemon/kvstashd" || rc=1
exit "$rc"
