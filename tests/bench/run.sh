#!/usr/bin/env bash
# tests/bench/run.sh - build (if needed) and run the RPC benchmark against the
# real daemon. Usage: tests/bench/run.sh [--quick]
# BUILD_DIR picks the build tree (default: build; configured if missing).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build=${BUILD_DIR:-build}

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build"
fi
cmake --build "$build" -j"$(nproc)" --target bench_rpc kvstashd

exec "$build/tests/bench/bench_rpc" "$@" "$build/daemon/kvstashd"
