#!/usr/bin/env bash
# tests/gpu/pack.sh BUILD DIR - pack a CUDA build for a lent GPU machine.
#
# The GPU machine is bare (no gRPC, protobuf-c, nanomsg, ...), sees the
# checkout but not ../shared, and ctest's files name the build's absolute
# path. This writes, into DIR (a folder of the checkout that git ignores,
# such as .gpu-data, so that it travels when the lending tool carries it):
#   DIR/build.tar.xz  BUILD without objects, with the shared libraries its
#                     programs need in BUILD/libs (never libcuda, the
#                     driver's own)
#   DIR/data/         the model and text of step torch-ppl
#   DIR/go.sh         run there, from the checkout's root:
#                       bash DIR/go.sh OUTDIR [STEPS]
#                     unpacks the build where it was built (linking that
#                     path to the checkout when they differ), deletes the
#                     carried libraries the machine has its own of (its
#                     torch needs its newer libstdc++ and OpenSSL), runs
#                     tests/gpu/run.sh (STEPS: KVSTASH_GPU_RUN_STEPS) and
#                     packs everything into OUTDIR/gpu-out.tgz
# docs/gpu.md "Carrying a build" says how the first runs used it.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: tests/gpu/pack.sh BUILD DIR" >&2
    exit 2
fi
BUILD=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SHARED=${KVSTASH_SHARED_DIR:-$REPO/../shared}
mkdir -p "$2"
DIR=$(cd "$2" && pwd)
case "$BUILD" in
"$REPO"/*) ;;
*)
    echo "pack.sh: $BUILD is not inside the checkout $REPO: it would not travel" >&2
    exit 2
    ;;
esac
if [ ! -x "$BUILD/tests/gpu/test_gpu_kernels" ]; then
    echo "pack.sh: $BUILD has no tests/gpu/test_gpu_kernels: configure it with -DKVSTASH_CUDA=ON and build it" >&2
    exit 2
fi

rm -rf "$BUILD/libs"
mkdir -p "$BUILD/libs"
find "$BUILD" -type f -perm -u+x \( -name 'kvstash*' -o -name 'kvs_*' -o -name 'test_*' \
    -o -name 'bench_*' -o -name 'libkvstash.so*' \) -print0 |
    xargs -0 ldd 2> /dev/null | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libcuda)\.so' |
    xargs -I{} cp -L {} "$BUILD/libs/"
tar -C "$REPO" --exclude=CMakeFiles --exclude='*.o' --exclude='*.a' \
    -cJf "$DIR/build.tar.xz" "${BUILD#"$REPO"/}"

mkdir -p "$DIR/data"
for f in stories260K.bin tok512.bin tinystories_val_dev.txt; do
    if [ -f "$SHARED/data/$f" ]; then
        cp "$SHARED/data/$f" "$DIR/data/"
    fi
done

cat > "$DIR/go.sh" << EOF
#!/usr/bin/env bash
# Written by tests/gpu/pack.sh: run from the checkout's root on the GPU machine.
set -u
if [ \$# -lt 1 ]; then
    echo "usage: bash ${DIR#"$REPO"/}/go.sh OUTDIR [STEPS]" >&2
    exit 2
fi
out=\$1
here=\$(pwd -P)
mkdir -p "\$out" /tmp/kvstash-gpu
if [ "\$(cd "$REPO" 2> /dev/null && pwd -P)" != "\$here" ]; then
    if [ -e "$REPO" ]; then
        echo "go.sh: $REPO exists and is not this checkout (\$here)" >&2
        exit 1
    fi
    mkdir -p "\$(dirname "$REPO")" && ln -s "\$here" "$REPO"
fi
cd "$REPO" || exit 1
tar -xJf "${DIR#"$REPO"/}/build.tar.xz" || exit 1
for f in "$BUILD"/libs/*; do
    if ldconfig -p | grep -q "/\$(basename "\$f")\$"; then
        rm -f "\$f"
    fi
done
KVSTASH_SHARED_DIR="${DIR#"$REPO"/}" KVSTASH_GPU_RUN_STEPS="\${2:-env ctest-gpu e2e-vmm e2e-legacy torch-ppl}" \\
    tests/gpu/run.sh "$BUILD" /tmp/kvstash-gpu/out
rc=\$?
tar -czf "\$out/gpu-out.tgz" -C /tmp/kvstash-gpu --exclude='*.sock*' out
exit \$rc
EOF
chmod +x "$DIR/go.sh"
echo "pack.sh: $(du -sh "$DIR" | cut -f1) in $DIR; on the GPU machine: bash ${DIR#"$REPO"/}/go.sh \"\$OUT\""
