"""py_worker.py - a Python worker process for the tests: kvs_test_worker's
job and output lines (tests/integration/kvs_test_worker.c), through the
kvstash package, so that tests/integration/worker_procs.py's WorkerProc can
drive either.

It attaches, creates --sequences sequences under --policy, appends --tokens
tokens to each, --step per append, writing K/V through the numpy views of
the pool (Session.block_keys / block_values) with values that are a function
of (seed, sequence, layer, head, position, channel); after every
--verify-every appends and at the end it reads every held token back
through kvs_layer_read and compares it with the values of its position.

stdout, one line each, flushed:
  ATTACHED session=<id> pool=<id>
  APPENDED <n>
  READY                      (--hold) done writing; waits for stdin EOF
  MISMATCH <details>
  {"ok": true, "seq_ids": [...], "tokens": N, "checked": M}   the last line
"""
import argparse
import json
import sys
import time

import numpy as np

import kvstash


def values(seed: int, seq: int, layer: int, heads: np.ndarray, positions: np.ndarray,
           head_dim: int, dtype: np.dtype) -> np.ndarray:
    """K of (heads x positions x channels): integers in [-1019, 1019], exact in
    fp16 and fp32; a bf16 pool (uint16 in numpy) gets their bit patterns."""
    h = heads.reshape(-1, 1, 1).astype(np.int64)
    p = positions.reshape(1, -1, 1).astype(np.int64)
    c = np.arange(head_dim, dtype=np.int64).reshape(1, 1, -1)
    x = (seed * 7919 + seq * 131 + layer * 31 + h * 17 + p * 3 + c) % 2039 - 1019
    return x.astype(dtype)


def v_of(k: np.ndarray) -> np.ndarray:
    if k.dtype == np.uint16:
        return k ^ np.uint16(0x5555)
    return -k - k.dtype.type(0.5)


def write_list(s: kvstash.Session, lst: kvstash.LayerList, k: np.ndarray, v: np.ndarray) -> None:
    """Write k, v ([kv_heads][n][d], or [n][d] per head) into the list's
    segments through the pool views: no libkvstash call."""
    t = 0
    g = s.geometry
    for block, first, count, _tier in lst.segments.tolist():
        if lst.per_head:
            rows_k = s.block_keys(block).reshape(g.kv_heads * g.block_tokens, g.head_dim)
            rows_v = s.block_values(block).reshape(g.kv_heads * g.block_tokens, g.head_dim)
            rows_k[first:first + count] = k[t:t + count]
            rows_v[first:first + count] = v[t:t + count]
        else:
            s.block_keys(block)[:, first:first + count, :] = k[:, t:t + count, :]
            s.block_values(block)[:, first:first + count, :] = v[:, t:t + count, :]
        t += count


def expected(o, s: kvstash.Session, si: int, lst: kvstash.LayerList, positions: np.ndarray):
    g = s.geometry
    heads = np.array([lst.head]) if lst.per_head else np.arange(g.kv_heads)
    k = values(o.seed, si, lst.layer, heads, positions, g.head_dim, g.numpy_dtype)
    if lst.per_head:
        k = k[0]
    return k, v_of(k)


def verify(o, s: kvstash.Session, seqs) -> int:
    """Read every held token back (kvs_layer_read); returns rows checked."""
    checked = 0
    for si, seq in enumerate(seqs):
        t = seq.table(with_positions=True)
        for lst in t.lists:
            if lst.tokens == 0:
                continue
            k, v = seq.read(lst)
            ek, ev = expected(o, s, si, lst, lst.positions)
            if not (np.array_equal(k, ek) and np.array_equal(v, ev)):
                bad = np.argwhere((k != ek).any(axis=-1))[0].tolist()
                print(f"MISMATCH seq={seq.id} layer={lst.layer} head={lst.head} at={bad}",
                      flush=True)
                sys.exit(1)
            checked += lst.tokens
    return checked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket")
    ap.add_argument("--model", default="test")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sleep-ms", type=int, default=0)
    ap.add_argument("--verify-every", type=int, default=1)
    ap.add_argument("--sequences", type=int, default=1)
    ap.add_argument("--name", default="py_worker")
    ap.add_argument("--hold", action="store_true")
    o = ap.parse_args()
    geo = kvstash.Geometry(o.layers, o.q_heads, o.kv_heads, o.head_dim, o.block_tokens, o.dtype)
    params = dict(kv.split("=", 1) for kv in o.set)
    try:
        with kvstash.Session.attach(o.model, geo, socket=o.socket, worker_name=o.name) as s:
            print(f"ATTACHED session={s.id} pool={s.pool_id}", flush=True)
            seqs = [s.create_sequence(o.policy, params, label=f"{o.name}-{i}")
                    for i in range(o.sequences)]
            appended = checked = appends = 0
            while appended < o.tokens:
                n = min(o.step, o.tokens - appended)
                for si, seq in enumerate(seqs):
                    t = seq.append(n)
                    pos = np.arange(t.first_position, t.first_position + n)
                    for lst in t.lists:
                        write_list(s, lst, *expected(o, s, si, lst, pos))
                    seq.step(new_tokens=n)
                appended += n
                appends += 1
                print(f"APPENDED {appended}", flush=True)
                if o.verify_every and appends % o.verify_every == 0:
                    checked += verify(o, s, seqs)
                if o.sleep_ms:
                    time.sleep(o.sleep_ms / 1000)
            checked += verify(o, s, seqs)
            if o.hold:
                print("READY", flush=True)
                sys.stdin.read()
                checked += verify(o, s, seqs)
            ids = [q.id for q in seqs]
            for q in seqs:
                q.release()
    except kvstash.KvstashError as e:
        print(json.dumps({"ok": False, "error": str(e), "code": e.code}), flush=True)
        return 2
    print(json.dumps({"ok": True, "seq_ids": ids, "tokens": appended, "checked": checked}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
