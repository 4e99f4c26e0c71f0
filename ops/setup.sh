#!/usr/bin/env bash
# ops/setup.sh - prepare a Debian 12 machine for kvstash and build it.
#
#   bash ops/setup.sh            install missing packages, build ./build (CUDA: AUTO)
#   bash ops/setup.sh --asan     also build ./build-asan (ASan+UBSan, no CUDA)
#   bash ops/setup.sh --tsan     also build ./build-tsan (ThreadSanitizer, no CUDA)
#   bash ops/setup.sh --release  also build ./build-release (Release: -O3, no CUDA)
#   bash ops/setup.sh --fuzz     also build ./build-fuzz's libFuzzer targets (clang, tests/fuzz)
#   bash ops/setup.sh --no-build only install packages
#
# Idempotent: apt is skipped when every package is already installed, and
# cmake rebuilds only what changed. Runs as root, or through sudo otherwise.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

asan=0
tsan=0
release=0
fuzz=0
build=1
for arg in "$@"; do
    case "$arg" in
    --asan) asan=1 ;;
    --tsan) tsan=1 ;;
    --release) release=1 ;;
    --fuzz) fuzz=1 ;;
    --no-build) build=0 ;;
    -h | --help)
        sed -n '2,12p' "${BASH_SOURCE[0]}"
        exit 0
        ;;
    *)
        echo "setup.sh: unknown option '$arg' (try --help)" >&2
        exit 2
        ;;
    esac
done

# What the build and the tests need, and nothing else.
packages=(
    build-essential cmake pkg-config
    libgrpc-dev protobuf-c-compiler libprotobuf-c-dev libnanomsg-dev
    libcmocka-dev libjansson-dev
    libmicrohttpd-dev libinih-dev
    protobuf-compiler protobuf-compiler-grpc
    python3 python3-grpcio python3-protobuf python3-prometheus-client
    python3-numpy python3-pytest python3-torch # client/python: the kvstash package, kvstash.llama
    tmux valgrind
    openssl util-linux # openssl: test_tls makes its CA; setpriv (util-linux): test_hostile_authz
    clang libclang-rt-14-dev # libFuzzer (tests/fuzz): clang-14's runtime is a separate package
    libhiredis-dev libisal-dev zlib1g-dev redis-server redis-tools # the remote tier (docs/remote.md): Redis Cluster, CRC-32 (ISA-L; zlib checks it in the tests)
)

missing=()
for p in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ "$status" = installed ] || missing+=("$p")
done

if [ "${#missing[@]}" -gt 0 ]; then
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || {
            echo "setup.sh: need root (or sudo) to install: ${missing[*]}" >&2
            exit 1
        }
        sudo=(sudo)
    fi
    echo "setup.sh: installing ${missing[*]}"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "setup.sh: all packages present"
fi

[ "$build" -eq 1 ] || exit 0

jobs=$(nproc)
cmake -S . -B build
cmake --build build -j"$jobs"
if [ "$asan" -eq 1 ]; then
    cmake -S . -B build-asan -DKVSTASH_SANITIZE=ON -DKVSTASH_CUDA=OFF
    cmake --build build-asan -j"$jobs"
fi
if [ "$tsan" -eq 1 ]; then
    cmake -S . -B build-tsan -DKVSTASH_SANITIZE_THREAD=ON -DKVSTASH_CUDA=OFF
    cmake --build build-tsan -j"$jobs"
fi
# libFuzzer needs clang; only the fuzz targets (and the libraries they link)
# are built there: the rest of the suite runs in the builds above.
if [ "$fuzz" -eq 1 ]; then
    CC=clang cmake -S . -B build-fuzz -DKVSTASH_FUZZ=ON -DKVSTASH_CUDA=OFF
    cmake --build build-fuzz -j"$jobs" --target fuzz
fi
# -O3 finds what RelWithDebInfo's -O2 does not (GCC's -Wmaybe-uninitialized
# with -Werror): a newcomer's first `-DCMAKE_BUILD_TYPE=Release` must build.
if [ "$release" -eq 1 ]; then
    cmake -S . -B build-release -DCMAKE_BUILD_TYPE=Release -DKVSTASH_CUDA=OFF
    cmake --build build-release -j"$jobs"
fi
