#!/usr/bin/env bash
# tests/gpu/run.sh BUILD OUTDIR - the GPU suite in one command (docs/gpu.md).
#
# BUILD is a CUDA build of the whole project (-DKVSTASH_CUDA=ON), on this
# machine or carried here (its shared libraries in BUILD/libs, found through
# LD_LIBRARY_PATH; docs/gpu.md "Carrying a build"). Every step writes its
# output under OUTDIR and one line to OUTDIR/summary.txt and stdout:
#   PASS <step> ...   FAIL <step> ...   SKIP <step>: <reason>
# Steps:
#   env            nvidia-smi -L and the driver (SKIP without nvidia-smi)
#   ctest-gpu      ctest -L gpu: the kernels, tiers and IPC suites and the
#                  daemon's device-free cuda checks (their device parts skip
#                  without a device)
#   e2e-<ipc>      once per IPC kind (vmm, legacy): kvstashd --backend cuda
#                  --cuda-ipc <ipc>; SKIP with kvstashd's reason when it
#                  cannot start (no usable device). Then:
#     two-workers  two kvs_test_worker processes on one pool (8 KV heads x
#                  128, 4096 tokens each): fp16 under `full` (every byte
#                  exact), and fp32 under `streaming int8=on victims=sketch`
#                  (the worker checks INT8 tokens within their bound, in fp32
#                  pools only), each reading back every held token
#     cli-tiers    a holding worker; kvstash demote / offload / revive on
#                  its sequence, the worker verifying after each move
#     tier-worker  kvs_tier_worker: INT8 + sketch revive of every position
#     sigkill      a worker killed with SIGKILL mid-append while another
#                  appends; the other finishes verified, a new one attaches;
#                  on cuda the victim's blocks were quarantined until its
#                  process was gone, then released (kvstashd's log, Stats)
#     status       Stats names the IPC kind asked for and the GPU's UUID
#     bandwidth    bench_device (tests/bench): a worker's writes and reads of
#                  a 4096-token layer through device buffers, its revive, the
#                  INT8 demotion of it and its revive, as ratios to cudaMemcpy
#                  device to device in the same process (every byte checked)
#   torch-ppl      python3 -m kvstash.llama score on stories260K (20 stories):
#                  --device cuda on a cuda pool against --device cpu on a host
#                  pool; the perplexities must agree within 1e-4 (relative).
#                  SKIP without torch with CUDA, or without the model data
#                  ($KVSTASH_SHARED_DIR/data, default the repository's
#                  ../shared; docs/gpu.md says how to carry it)
# Exit status: 0 when nothing FAILed (SKIPs allowed), 1 otherwise, 2 usage.
#
# KVSTASH_GPU_RUN_BACKEND=host runs the e2e steps on the host backend: a
# dry run of this script's own logic on a machine without a GPU.
# KVSTASH_GPU_RUN_TOKENS (default 4096) sets the tokens per worker;
# KVSTASH_PYTHON (default python3) the Python with torch of step torch-ppl;
# KVSTASH_GPU_RUN_STEPS (default all: "env ctest-gpu e2e-vmm e2e-legacy
# torch-ppl") the steps to run, to rerun what failed within a short lease.
set -u

if [ $# -ne 2 ]; then
    echo "usage: tests/gpu/run.sh BUILD OUTDIR" >&2
    exit 2
fi
BUILD=$(cd "$1" && pwd) || exit 2
mkdir -p "$2" || exit 2
OUT=$(cd "$2" && pwd)
BACKEND=${KVSTASH_GPU_RUN_BACKEND:-cuda}
TOKENS=${KVSTASH_GPU_RUN_TOKENS:-4096}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SHARED=${KVSTASH_SHARED_DIR:-$REPO/../shared}
PYTHON=${KVSTASH_PYTHON:-python3}
STEPS=${KVSTASH_GPU_RUN_STEPS:-env ctest-gpu e2e-vmm e2e-legacy torch-ppl}
KVSTASHD=$BUILD/daemon/kvstashd
BENCH_DEVICE=$BUILD/tests/bench/bench_device
CLI=$BUILD/client/kvstash
WORKER=$BUILD/tests/kvs_test_worker
TIER_WORKER=$BUILD/tests/kvs_tier_worker
if [ -d "$BUILD/libs" ]; then
    export LD_LIBRARY_PATH="$BUILD/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
: > "$OUT/summary.txt"
FAILED=0
PIDS=()

say() { echo "$*" | tee -a "$OUT/summary.txt"; }
pass() { say "PASS $*"; }
fail() { say "FAIL $*"; FAILED=1; }
skip() { say "SKIP $1: $2"; }

# Stop only what this script started, by process id.
# shellcheck disable=SC2317  # called by the trap
cleanup() {
    for p in "${PIDS[@]:-}"; do
        [ -n "$p" ] && kill "$p" 2>/dev/null
    done
}
trap cleanup EXIT

for f in "$KVSTASHD" "$CLI" "$WORKER" "$TIER_WORKER" "$BENCH_DEVICE"; do
    if [ ! -x "$f" ]; then
        echo "run.sh: $f is missing: BUILD must be a full build (not KERNELS_ONLY)" >&2
        exit 2
    fi
done

# ---- env --------------------------------------------------------------------
step_env() {
    if ! command -v nvidia-smi > /dev/null 2>&1; then
        skip env "nvidia-smi not found (no NVIDIA driver on this host)"
        return
    fi
    if {
        date -u +%Y-%m-%dT%H:%M:%SZ
        nvidia-smi -L
        nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
    } > "$OUT/env.txt" 2>&1; then
        pass env "$(grep -c '^GPU ' "$OUT/env.txt") GPU(s): $(sed -n 2p "$OUT/env.txt")"
    else
        fail env "nvidia-smi failed: $(tail -1 "$OUT/env.txt")"
    fi
}

# ---- ctest -L gpu -----------------------------------------------------------
step_ctest() {
    ctest --test-dir "$BUILD" -L gpu --output-on-failure -V > "$OUT/ctest_gpu.log" 2>&1
    local rc=$? skipped
    skipped=$(grep -c '\*\*\*Skipped' "$OUT/ctest_gpu.log")
    if [ $rc -eq 0 ]; then
        pass ctest-gpu "$(grep -E 'tests passed' "$OUT/ctest_gpu.log") ($skipped skipped: see ctest_gpu.log)"
    else
        fail ctest-gpu "$(grep -E 'tests passed' "$OUT/ctest_gpu.log")"
    fi
    grep -E '^[0-9]+: (SKIP|bench)' "$OUT/ctest_gpu.log" | sed 's/^[0-9]*: /  /' | tee -a "$OUT/summary.txt"
}

# ---- end to end -------------------------------------------------------------
# Start kvstashd for one IPC kind in $1 (its directory), on backend $3
# (default $BACKEND); 0 when serving, 1 when it could not start (its log
# says why), 2 when it hung.
start_daemon() {
    local dir=$1 ipc=$2 backend=${3:-$BACKEND}
    "$KVSTASHD" --socket "$dir/s.sock" --backend "$backend" --cuda-ipc "$ipc" --pool-mb 2048 \
        --log-level info > "$dir/kvstashd.log" 2>&1 &
    DAEMON=$!
    PIDS+=("$DAEMON")
    for _ in $(seq 300); do
        if [ -S "$dir/s.sock.fd" ] && "$CLI" --socket "$dir/s.sock" health > /dev/null 2>&1; then
            return 0
        fi
        if ! kill -0 "$DAEMON" 2>/dev/null; then
            return 1
        fi
        sleep 0.1
    done
    return 2
}

# The worker's last line is its JSON result; "ok":true and checked > 0.
worker_ok() {
    tail -1 "$1" | grep -q '"ok":true' && ! tail -1 "$1" | grep -q '"checked":0[,}]'
}

geometry=(--layers 2 --kv-heads 8 --q-heads 32 --head-dim 128 --block-tokens 16)

e2e_two_workers() {
    local dir=$1 sock=$1/s.sock a b
    "$WORKER" --socket "$sock" --model e2e16 "${geometry[@]}" --dtype fp16 --policy full \
        --tokens "$TOKENS" --step 64 --seed 1 --verify-every 16 --name a --dev-io \
        > "$dir/a.out" 2> "$dir/a.err" &
    a=$!
    "$WORKER" --socket "$sock" --model e2e32 "${geometry[@]}" --dtype fp32 --policy streaming \
        --set n_sink=4 --set window=1024 --set int8=on --set victims=sketch \
        --tokens "$TOKENS" --step 64 --seed 2 --verify-every 16 --name b > "$dir/b.out" 2> "$dir/b.err" &
    b=$!
    PIDS+=("$a" "$b")
    wait "$a"; local ra=$?
    wait "$b"; local rb=$?
    if [ $ra -eq 0 ] && [ $rb -eq 0 ] && worker_ok "$dir/a.out" && worker_ok "$dir/b.out"; then
        pass "$2/two-workers" "fp16 full (device buffers): $(tail -1 "$dir/a.out" | grep -o '"checked":[0-9]*'); fp32 streaming int8+sketch: $(tail -1 "$dir/b.out" | grep -o '"checked":[0-9]*')"
    else
        fail "$2/two-workers" "exit $ra/$rb: $(tail -1 "$dir/a.out") | $(tail -1 "$dir/b.out") | $(tail -2 "$dir/a.err" "$dir/b.err" | tr '\n' ' ')"
    fi
}

# Ask the holding worker to verify; prints its VERIFIED line.
verify_now() {
    local dir=$1 n
    n=$(grep -c '^VERIFIED' "$dir/h.out")
    echo >&7
    for _ in $(seq 600); do
        [ "$(grep -c '^VERIFIED' "$dir/h.out")" -gt "$n" ] && break
        grep -q '^MISMATCH\|"ok":false' "$dir/h.out" && break
        sleep 0.1
    done
    grep '^VERIFIED\|^MISMATCH\|"ok":false' "$dir/h.out" | tail -1
}

e2e_cli_tiers() {
    local dir=$1 sock=$1/s.sock h sid line ok=1 n=$((TOKENS / 4))
    mkfifo "$dir/h.in"
    exec 7<> "$dir/h.in"
    "$WORKER" --socket "$sock" --model e2ecli "${geometry[@]}" --dtype fp32 --policy full \
        --tokens "$n" --step 64 --seed 3 --verify-every 1000000 --name h --hold \
        < "$dir/h.in" > "$dir/h.out" 2> "$dir/h.err" 7>&- &
    h=$!
    PIDS+=("$h")
    for _ in $(seq 1200); do
        grep -q '^READY' "$dir/h.out" && break
        kill -0 "$h" 2>/dev/null || break
        sleep 0.1
    done
    local sess
    sess=$(sed -n 's/^ATTACHED session=\([0-9]*\).*/\1/p' "$dir/h.out")
    sid=$("$CLI" --socket "$sock" seqs --json | tr -d ' \n' |
          grep -o "\"seq_id\":[0-9]*,\"session_id\":${sess:-x}[,}]" | head -1 | sed 's/^"seq_id":\([0-9]*\),.*/\1/')
    if ! grep -q '^READY' "$dir/h.out" || [ -z "$sid" ]; then
        fail "$2/cli-tiers" "the holding worker did not get ready: $(tail -2 "$dir/h.out" "$dir/h.err" | tr '\n' ' ')"
        exec 7>&-
        return
    fi
    for move in "demote $sid 0-$((n / 2 - 1))" "offload $sid $((n / 4))-$((n / 2 + 9))" \
                "revive $sid 0-$((n - 1))"; do
        # shellcheck disable=SC2086
        if ! "$CLI" --socket "$sock" $move --json > "$dir/cli.out" 2>&1; then
            ok=0
            fail "$2/cli-tiers" "kvstash $move: $(tail -3 "$dir/cli.out" | tr '\n' ' ')"
            break
        fi
        line=$(verify_now "$dir")
        echo "kvstash $move -> $(tr -d ' \n' < "$dir/cli.out") -> $line" >> "$dir/cli-tiers.txt"
        case $line in
        VERIFIED*) ;;
        *)
            ok=0
            fail "$2/cli-tiers" "after kvstash $move: $line"
            break
            ;;
        esac
    done
    exec 7>&- # EOF on its stdin: the worker verifies once more and exits
    for _ in $(seq 1200); do
        kill -0 "$h" 2>/dev/null || break
        sleep 0.1
    done
    kill -TERM "$h" 2>/dev/null # still there after 120 s: it is told to finish
    wait "$h"
    local rc=$?
    if [ $ok -eq 1 ] && [ $rc -eq 0 ] && worker_ok "$dir/h.out"; then
        pass "$2/cli-tiers" "$(tr '\n' ';' < "$dir/cli-tiers.txt" | cut -c1-400)"
    elif [ $ok -eq 1 ]; then
        fail "$2/cli-tiers" "worker exit $rc: $(tail -1 "$dir/h.out")"
    fi
}

e2e_tier_worker() {
    local dir=$1
    if "$TIER_WORKER" --socket "$dir/s.sock" --tokens 96 --int8 on --victims sketch --buckets 7 \
        --window 24 > "$dir/tier.out" 2> "$dir/tier.err"; then
        pass "$2/tier-worker" "$(tail -1 "$dir/tier.out" | cut -c1-200)"
    else
        fail "$2/tier-worker" "$(tail -1 "$dir/tier.out") $(tail -2 "$dir/tier.err" | tr '\n' ' ')"
    fi
}

e2e_sigkill() {
    local dir=$1 sock=$1/s.sock k s n
    : > "$dir/k.out" # before the background job opens it: the wait below reads it at once
    "$WORKER" --socket "$sock" --model e2ekill "${geometry[@]}" --dtype fp16 --policy full \
        --tokens "$TOKENS" --step 16 --sleep-ms 20 --seed 4 --name victim > "$dir/k.out" 2> "$dir/k.err" &
    k=$!
    "$WORKER" --socket "$sock" --model e2ekill "${geometry[@]}" --dtype fp16 --policy full \
        --tokens "$TOKENS" --step 64 --seed 5 --verify-every 16 --name survivor > "$dir/s.out" 2> "$dir/s.err" &
    s=$!
    PIDS+=("$k" "$s")
    for _ in $(seq 600); do
        grep -q '^APPENDED' "$dir/k.out" && break
        sleep 0.05
    done
    sleep 0.5
    kill -KILL "$k" 2>/dev/null
    wait "$k" 2>/dev/null
    wait "$s"
    local rs=$?
    "$WORKER" --socket "$sock" --model e2ekill "${geometry[@]}" --dtype fp16 --policy full \
        --tokens 64 --step 16 --seed 6 --name after > "$dir/n.out" 2> "$dir/n.err"
    local rn=$?
    n=$(grep -c '^APPENDED' "$dir/k.out")
    # The cuda backend quarantines a vanished worker's blocks until its
    # process is gone (--lease-end auto): both log lines, nothing left held.
    local held quarantine="lease end free (host backend)"
    held=$("$CLI" --socket "$sock" status --json | tr -d ' \n' | grep -o '"quarantined_blocks":[0-9]*' | cut -d: -f2)
    if [ "$BACKEND" = cuda ]; then
        quarantine="quarantined: $(grep -c 'session_quarantined' "$dir/kvstashd.log"), released: $(grep -c 'quarantine_released' "$dir/kvstashd.log"), held now: ${held:-?}"
        if ! grep -q 'quarantine_released' "$dir/kvstashd.log" || [ "${held:-1}" != 0 ]; then
            fail "$2/sigkill" "the victim's blocks were not quarantined and released: $quarantine"
            return
        fi
    fi
    if [ $rs -eq 0 ] && worker_ok "$dir/s.out" && [ $rn -eq 0 ] && worker_ok "$dir/n.out"; then
        pass "$2/sigkill" "victim killed after $n appends; survivor $(tail -1 "$dir/s.out" | grep -o '"checked":[0-9]*'), a new worker attached and verified; $quarantine"
    else
        fail "$2/sigkill" "survivor exit $rs: $(tail -1 "$dir/s.out"); new worker exit $rn: $(tail -1 "$dir/n.out")"
    fi
}

# Stats after the first pool: the IPC kind asked for and the GPU by UUID
# (memfd and "none" on the host backend).
e2e_status() {
    local dir=$1 want=$3 st ipc device
    st=$("$CLI" --socket "$dir/s.sock" status --json | tr -d ' \n')
    ipc=$(echo "$st" | grep -o '"ipc":"[^"]*"' | head -1 | cut -d'"' -f4)
    device=$(echo "$st" | grep -o '"device":"[^"]*"' | head -1 | cut -d'"' -f4)
    [ "$BACKEND" = cuda ] || want=memfd
    if [ "$ipc" = "$want" ] && { [ "$BACKEND" != cuda ] || [[ $device == GPU-* ]]; }; then
        pass "$2/status" "device $device, ipc $ipc"
    else
        fail "$2/status" "Stats says device '$device', ipc '$ipc'; expected ipc $want and a GPU UUID"
    fi
}

e2e_bandwidth() {
    local dir=$1
    if "$BENCH_DEVICE" --socket "$dir/s.sock" --tokens "$TOKENS" > "$dir/bandwidth.txt" \
        2> "$dir/bandwidth.err"; then
        pass "$2/bandwidth" "$(tail -1 "$dir/bandwidth.txt")"
        sed 's/^/  /' "$dir/bandwidth.txt" >> "$OUT/summary.txt"
    else
        fail "$2/bandwidth" "$(tail -1 "$dir/bandwidth.txt") $(tail -2 "$dir/bandwidth.err" | tr '\n' ' ')"
    fi
}

step_e2e() {
    local ipc=$1 dir=$OUT/e2e-$1 rc
    mkdir -p "$dir"
    start_daemon "$dir" "$ipc"
    rc=$?
    if [ $rc -eq 1 ]; then
        local why
        why=$(grep -o 'msg="[^"]*"' "$dir/kvstashd.log" | tail -1)
        if grep -q 'no usable CUDA device' "$dir/kvstashd.log"; then
            skip "e2e-$ipc" "kvstashd --backend $BACKEND did not start: $why"
        else
            fail "e2e-$ipc" "kvstashd exited: $(tail -2 "$dir/kvstashd.log" | tr '\n' ' ')"
        fi
        return
    elif [ $rc -eq 2 ]; then
        fail "e2e-$ipc" "kvstashd did not answer health in 30 s"
        return
    fi
    grep -E 'cuda_device|cuda_arena|cuda_ipc_fallback' "$dir/kvstashd.log" | sed 's/^/  /' | tee -a "$OUT/summary.txt"
    e2e_two_workers "$dir" "e2e-$ipc"
    e2e_status "$dir" "e2e-$ipc" "$ipc"
    e2e_cli_tiers "$dir" "e2e-$ipc"
    e2e_tier_worker "$dir" "e2e-$ipc"
    e2e_sigkill "$dir" "e2e-$ipc"
    e2e_bandwidth "$dir" "e2e-$ipc"
    grep -E 'cuda_arena' "$dir/kvstashd.log" | sed 's/^/  /' | tee -a "$OUT/summary.txt"
    kill -TERM "$DAEMON"
    wait "$DAEMON"
    rc=$?
    if [ $rc -eq 0 ]; then
        pass "e2e-$ipc/stop" "kvstashd exited 0 on SIGTERM"
    else
        fail "e2e-$ipc/stop" "kvstashd exited $rc: $(tail -2 "$dir/kvstashd.log" | tr '\n' ' ')"
    fi
}

# ---- the PyTorch worker on the GPU --------------------------------------------
# Score with python3 -m kvstash.llama against the daemon in $1 on device $2;
# prints the summary's ppl (empty on failure; the log says why).
llama_ppl() {
    local dir=$1 device=$2
    PYTHONPATH="$REPO/client/python${PYTHONPATH:+:$PYTHONPATH}" KVSTASH_LIB="$BUILD/client/libkvstash.so" \
        "$PYTHON" -m kvstash.llama score --socket "$dir/s.sock" --device "$device" --stories 20 \
        --quiet --model "$SHARED/data/stories260K.bin" --text "$SHARED/data/tinystories_val_dev.txt" \
        > "$dir/score.out" 2> "$dir/score.err"
    tail -1 "$dir/score.out" | grep -o '"ppl":[0-9.e+-]*' | cut -d: -f2
}

step_torch_ppl() {
    local dir=$OUT/torch-ppl gpu_dev=cuda
    mkdir -p "$dir/gpu" "$dir/host"
    if [ "$BACKEND" = host ]; then
        gpu_dev=cpu # the dry run: both daemons on the host backend
    elif ! "$PYTHON" -c 'import numpy, torch; assert torch.cuda.is_available()' > "$dir/torch.txt" 2>&1; then
        skip torch-ppl "$PYTHON has no numpy or no torch with CUDA: $(tail -1 "$dir/torch.txt")"
        return
    fi
    if [ ! -f "$SHARED/data/stories260K.bin" ]; then
        skip torch-ppl "no $SHARED/data/stories260K.bin (set KVSTASH_SHARED_DIR; docs/gpu.md)"
        return
    fi
    local gpu_d host_d a b
    if ! start_daemon "$dir/gpu" auto; then
        skip torch-ppl "kvstashd --backend $BACKEND did not start: $(tail -1 "$dir/gpu/kvstashd.log")"
        return
    fi
    gpu_d=$DAEMON
    if ! start_daemon "$dir/host" auto host; then
        fail torch-ppl "kvstashd --backend host did not start: $(tail -1 "$dir/host/kvstashd.log")"
        kill -TERM "$gpu_d"
        return
    fi
    host_d=$DAEMON
    a=$(llama_ppl "$dir/gpu" "$gpu_dev")
    b=$(llama_ppl "$dir/host" cpu)
    kill -TERM "$gpu_d" "$host_d"
    wait "$gpu_d" "$host_d"
    if [ -z "$a" ] || [ -z "$b" ]; then
        fail torch-ppl "a score failed: $(tail -2 "$dir/gpu/score.err" "$dir/host/score.err" | tr '\n' ' ')"
    elif "$PYTHON" -c "import sys; a, b = $a, $b; sys.exit(abs(a - b) > 1e-4 * b)"; then
        pass torch-ppl "stories260K, 20 stories: ppl $a (--device $gpu_dev, $BACKEND pool) vs $b (cpu, host pool)"
    else
        fail torch-ppl "ppl $a (--device $gpu_dev, $BACKEND pool) vs $b (cpu, host pool): more than 1e-4 apart"
    fi
}

echo "run.sh: build $BUILD, output $OUT, backend $BACKEND, $TOKENS tokens per worker, steps: $STEPS"
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
wanted env && step_env
wanted ctest-gpu && step_ctest
wanted e2e-vmm && step_e2e vmm
wanted e2e-legacy && step_e2e legacy
wanted torch-ppl && step_torch_ppl
echo "run.sh: summary in $OUT/summary.txt"
exit $FAILED
