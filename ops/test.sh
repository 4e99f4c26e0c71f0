#!/usr/bin/env bash
# ops/test.sh - build kvstash twice (./build as configured by setup.sh, and
# ./build-asan with AddressSanitizer + UBSan) and run the whole test suite in
# both. With KVSTASH_BENCH=1 it also runs the RPC benchmark in quick mode.
# Exits non-zero if any build, test or the benchmark fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash ops/setup.sh --asan

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
