#!/usr/bin/env bash
# ops/test.sh - build kvstash four times (./build as configured by setup.sh,
# ./build-asan with AddressSanitizer + UBSan, ./build-tsan with
# ThreadSanitizer, ./build-release with -DCMAKE_BUILD_TYPE=Release), run the
# whole test suite in the first three and the unit tests in build-release
# (-O3 must compile and behave). With KVSTASH_BENCH=1 it also runs the
# benchmarks (tests/bench/run.sh: bench_rpc, bench_tiers) in quick mode.
# Exits non-zero if any build, test or the benchmark fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash ops/setup.sh --asan --tsan --release

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
