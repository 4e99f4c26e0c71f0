#!/usr/bin/env bash
# ops/run-demo.sh - build kvstash, start kvstashd on host shared memory, run a
# real model as its worker (kvstash-llama: stories260K from ../shared/data
# generates a story with its KV cache in kvstashd under h2o at 32 tokens per
# layer, old tokens in INT8), show what the cache holds as it goes and the
# daemon's status, and stop the daemon. Exits non-zero if any step fails; the
# daemon is stopped in every case.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash ops/setup.sh

daemon=build/daemon/kvstashd
llama=build/client/llama/kvstash-llama
cli=build/client/kvstash
data=../shared/data
if [ ! -f "$data/stories260K.bin" ]; then
    echo "run-demo: $data/stories260K.bin is missing (../shared must sit beside this checkout)" >&2
    exit 1
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvstash-demo.XXXXXX")
sock=$tmp/kvstashd.sock
log=$tmp/kvstashd.log
pid=

# True while process $1 runs (a zombie that exited does not count).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat:0:1}" != Z ]
}

# Send SIGTERM to the daemon, give it 10 s, then SIGKILL. Returns its status.
stop_daemon() {
    local p=$pid rc=0
    pid=
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
    if alive "$p"; then
        echo "run-demo: kvstashd ignored SIGTERM for 10 s; killing it" >&2
        kill -KILL "$p" 2>/dev/null || true
    fi
    wait "$p" || rc=$?
    return "$rc"
}

cleanup() {
    local rc=$?
    if [ -n "$pid" ]; then stop_daemon || true; fi
    if [ "$rc" -ne 0 ] && [ -s "$log" ]; then
        echo "--- kvstashd log (last 40 lines) ---" >&2
        tail -n 40 "$log" >&2
    fi
    rm -rf "$tmp"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== starting kvstashd on $sock (log: stderr captured)"
"$daemon" --socket "$sock" 2>"$log" &
pid=$!

for _ in $(seq 100); do
    [ -S "$sock" ] && break
    alive "$pid" || break
    sleep 0.1
done
if [ ! -S "$sock" ]; then
    if alive "$pid"; then
        echo "run-demo: kvstashd did not create $sock within 10 s" >&2
    else
        rc=0
        wait "$pid" || rc=$?
        pid=
        echo "run-demo: kvstashd exited (status $rc) before creating $sock" >&2
    fi
    exit 1
fi

echo "== kvstash-llama generate: stories260K, policy h2o, 32 tokens per layer, INT8 on"
echo "   (every 32 tokens, stderr shows what kvstashd holds: tokens and bytes per tier)"
"$llama" generate --socket "$sock" --model "$data/stories260K.bin" \
    --tokenizer "$data/tok512.bin" --policy h2o --budget 32 --int8 on --watch 32 \
    --steps 200 --prompt "Once upon a time"

echo "== kvstash seqs --socket $sock (the worker detached: nothing is left)"
"$cli" seqs --socket "$sock"

echo "== kvstash status --socket $sock"
"$cli" status --socket "$sock"

echo "== stopping kvstashd"
rc=0
stop_daemon || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "run-demo: kvstashd exited with status $rc" >&2
    exit 1
fi
echo "== done: kvstashd exited cleanly"
