#!/usr/bin/env bash
# tests/fuzz/run_long.sh - the long fuzz run (docs/reliability.md):
# every target of a KVSTASH_FUZZ build for --runs executions on a copy of its
# seed corpus, then one summary line per target: executions, exec/s,
# coverage (cov = edges, ft = features) and findings (crash-, leak-,
# timeout-, oom- files in OUT/artifacts/TARGET).
#
#   bash tests/fuzz/run_long.sh [--build DIR] [--out DIR] [--runs N] [--jobs J]
#                               [--max-time S] [--nice] [TARGET...]
#
# --build  the fuzz build (default ./build-fuzz: ops/setup.sh --fuzz)
# --out    corpora, logs and artifacts (default BUILD/fuzz-long); corpora
#          grow across runs, so a second run continues the first
# --runs   executions per target (default 10000000), split over the jobs
# --jobs   parallel fuzzing processes per target (libFuzzer -jobs/-workers)
# --max-time  stop a target after S seconds even below --runs (0 = never)
# --nice   run at nice 19 (a shared machine)
# Exits 1 if any target left a finding.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."

build=build-fuzz
out=
runs=10000000
jobs=1
max_time=0
nice=()
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --max-time) max_time=$2; shift 2 ;;
    --nice) nice=(nice -n 19); shift ;;
    -h | --help) sed -n '2,19p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "run_long.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
    esac
done
[ -n "$out" ] || out=$build/fuzz-long
[ "${#targets[@]}" -gt 0 ] || targets=(fuzz_rpc fuzz_ring fuzz_fdsock fuzz_replay fuzz_config)

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
found=0
echo "run_long.sh: $(date -u +%FT%TZ) runs=$runs jobs=$jobs max_time=$max_time build=$build"
for t in "${targets[@]}"; do
    bin=$build/tests/fuzz/$t
    [ -x "$bin" ] || { echo "run_long.sh: $bin not built (ops/setup.sh --fuzz)" >&2; exit 2; }
    corpus=$out/corpus/$t
    art=$out/artifacts/$t
    logs=$out/logs/$t
    mkdir -p "$corpus" "$art" "$logs"
    rm -f "$logs"/*.log
    args=(-runs=$((runs / jobs)) -max_total_time="$max_time" -timeout=60 -rss_limit_mb=2048
          -print_final_stats=1 -artifact_prefix="$art/")
    start=$(date +%s)
    if [ "$jobs" -gt 1 ]; then
        # -jobs writes fuzz-<n>.log in the working directory.
        (cd "$logs" && "${nice[@]}" "$OLDPWD/$bin" "${args[@]}" -jobs="$jobs" -workers="$jobs" \
            "$OLDPWD/$corpus" "$OLDPWD/tests/fuzz/corpus/$t" >/dev/null 2>&1) || true
    else
        "${nice[@]}" "$bin" "${args[@]}" "$corpus" "tests/fuzz/corpus/$t" >"$logs/fuzz-0.log" 2>&1 ||
            true
    fi
    secs=$(($(date +%s) - start))
    execs=0
    for f in "$logs"/*.log; do
        n=$(sed -n 's/^stat::number_of_executed_units: //p' "$f" | tail -1)
        execs=$((execs + ${n:-0}))
    done
    last=$(grep -hE '^#[0-9]+[[:space:]].*cov: ' "$logs"/*.log | tail -1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    nfind=$(find "$art" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
        -o -name 'oom-*' \) | wc -l)
    [ "$nfind" -eq 0 ] || found=1
    echo "$t: executions=$execs seconds=$secs exec/s=$((execs / (secs > 0 ? secs : 1)))" \
        "cov=${cov:-?} ft=${ft:-?} findings=$nfind"
done
exit "$found"
