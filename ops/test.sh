#!/usr/bin/env bash
# ops/test.sh - build kvstash five times (./build as configured by setup.sh,
# ./build-asan with AddressSanitizer + UBSan, ./build-tsan with
# ThreadSanitizer, ./build-release with -DCMAKE_BUILD_TYPE=Release, and the
# libFuzzer targets in ./build-fuzz with clang), run the whole test suite in
# the first three, the unit tests in build-release (-O3 must compile and
# behave) and each fuzz target for 20 s on its seed corpus (ctest -L fuzz,
# docs/reliability.md). With KVSTASH_BENCH=1 it also runs the
# benchmarks (tests/bench/run.sh: bench_rpc, bench_tiers) in quick mode.
# Exits non-zero if any build, test or the benchmark fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash ops/setup.sh --asan --tsan --release --fuzz

failed=()

echo "== ctest: build"
if ! ctest --test-dir build --output-on-failure -j2; then
    failed+=("ctest build")
fi

echo "== ctest: build-asan"
if ! env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j2; then
    failed+=("ctest build-asan")
fi

# TSan maps its shadow memory at fixed addresses, which some kernels' address
# randomisation collides with ("unexpected memory mapping"): run without it.
norandom=()
if command -v setarch >/dev/null; then
    norandom=(setarch "$(uname -m)" -R)
fi
echo "== ctest: build-tsan"
if ! "${norandom[@]}" ctest --test-dir build-tsan --output-on-failure -j2; then
    failed+=("ctest build-tsan")
fi

# Release: the unit tests only (the integration suite adds nothing the other
# builds do not check, and doubles the time).
echo "== ctest: build-release (unit)"
if ! ctest --test-dir build-release --output-on-failure -j2 -L unit; then
    failed+=("ctest build-release")
fi

# Fuzz: each target 20 s on its seeds (a crash, leak, UB or hang fails it).
echo "== ctest: build-fuzz (fuzz)"
if ! ctest --test-dir build-fuzz --output-on-failure -j2 -L fuzz; then
    failed+=("ctest build-fuzz")
fi

if [ "${KVSTASH_BENCH:-0}" = 1 ]; then
    echo "== benchmark (quick)"
    if ! bash tests/bench/run.sh --quick; then
        failed+=("benchmark")
    fi
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "test.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test.sh: all passed"
