#!/usr/bin/python3
"""Seed corpora for the fuzz targets (tests/fuzz/fuzz_*.c), written from the
messages the integration tests send, in each target's input format.

    /usr/bin/python3 tests/fuzz/make_corpus.py [--stubs BUILD/tests/py] [--out tests/fuzz/corpus]

--stubs is where CMake put the Python protobuf stubs (any build dir's
tests/py). The method numbers of fuzz_rpc come from the order of
daemon/service.c's method table, read from the source, so a new method
cannot shift the seeds silently. Files named regress-* in the corpus are
committed by hand: inputs that once found a bug (docs/reliability.md). The fixture the daemon targets run on
(tests/fuzz/fuzz_store.h): pool 1 (model "m"), session 0 with sequence 1
("full", 3 tokens), session 1, the operator, with sequence 2 ("h2o", 3
tokens); the fixture
builds a fresh store for every input, so these ids hold in every run.
"""
import argparse
import importlib.util
import os
import re
import struct
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# fuzz_rpc's caller byte: no token, session 0, session 1, unknown, empty.
NONE, S0, S1, UNKNOWN, EMPTY = range(5)


def method_numbers():
    text = open(os.path.join(ROOT, "daemon", "service.c")).read()
    table = text[text.index("static const rpc_method methods[]"):]
    paths = re.findall(r'\{"(/[A-Za-z0-9_.]+/[A-Za-z]+)"', table)
    return {p.rsplit("/", 1)[1]: i for i, p in enumerate(paths)}


def write(out, target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def rpc_seeds(pb, health_pb):
    m = method_numbers()

    def call(method, caller, msg):
        body = msg.SerializeToString()
        return struct.pack("<BBH", m[method], caller, len(body)) + body

    def params(**kw):
        return [pb.Param(key=k, value=str(v)) for k, v in kw.items()]

    geom = pb.Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=8, block_tokens=4,
                       dtype=pb.DTYPE_FP32)
    seeds = {
        "attach-again": call("Attach", S0, pb.AttachRequest(model="m", geometry=geom,
                                                           worker_name="w")),
        "attach-tenant": call("Attach", S1, pb.AttachRequest(model="other", geometry=geom,
                                                            worker_name="w", tenant="t1")),
        "lease-stats": call("Lease", S0, pb.LeaseRequest())
        + call("Stats", S0, pb.StatsRequest(with_tiers=True)),
        "stats-none": call("Stats", NONE, pb.StatsRequest(with_tiers=True)),
        "list-policies": call("ListPolicies", NONE, pb.ListPoliciesRequest()),
        "health": call("Check", UNKNOWN, health_pb.HealthCheckRequest(service="kvstash.v1.Store")),
        "detach": call("Detach", S1, pb.DetachRequest()),
        "inspect-own": call("Inspect", S0, pb.InspectRequest(seq_id=1, with_map=True)),
        "inspect-other": call("Inspect", S1, pb.InspectRequest(seq_id=1, with_map=True)),
        "evict-not-operator": call("Evict", S0, pb.EvictRequest(
            seq_id=2, ranges=[pb.PositionRange(first=0, count=1)])),
        "evict-other": call("Evict", S1, pb.EvictRequest(
            seq_id=1, ranges=[pb.PositionRange(first=0, count=1)])),
        "evict-no-token": call("Evict", NONE, pb.EvictRequest(
            seq_id=2, ranges=[pb.PositionRange(first=1, count=2)], to="int8")),
        "empty-token": call("GetBlockTable", EMPTY, pb.GetBlockTableRequest(seq_id=1)),
        "append-huge": call("Append", S0, pb.AppendRequest(seq_id=1, count=65536)),
        "workflow": call("CreateSequence", S0, pb.CreateSequenceRequest(
            policy="streaming", params=params(window=4, n_sink=1), label="fuzz"))
        + call("Append", S0, pb.AppendRequest(seq_id=3, count=10))
        + call("GetBlockTable", S0, pb.GetBlockTableRequest(seq_id=3, with_positions=True))
        + call("Evict", S0, pb.EvictRequest(seq_id=3, ranges=[pb.PositionRange(first=0, count=2)],
                                            to="int8"))
        + call("Revive", S0, pb.ReviveRequest(seq_id=3, layer=0, first=0, count=4,
                                              skip_evicted=True))
        + call("ReleaseScratch", S0, pb.ReleaseScratchRequest(scratch_id=1))
        + call("Inspect", S0, pb.InspectRequest(seq_id=3, with_map=True, max_runs=4))
        + call("ReleaseSequence", S0, pb.ReleaseSequenceRequest(seq_id=3))
        + call("Detach", S0, pb.DetachRequest()),
        "sketch": call("CreateSequence", S1, pb.CreateSequenceRequest(
            policy="streaming", params=params(window=8, n_sink=0, victims="sketch",
                                              sketch_rows=3, sketch_buckets=64)))
        + call("Append", S1, pb.AppendRequest(seq_id=3, count=20))
        + call("Stats", S1, pb.StatsRequest(with_tiers=True))
        + call("Revive", S1, pb.ReviveRequest(seq_id=3, layer=1, first=0, count=0)),
    }
    for policy in ("full", "streaming", "h2o", "weightedkv", "adakv", "snapkv", "tova", "nope"):
        seeds["create-" + policy] = call("CreateSequence", S0,
                                         pb.CreateSequenceRequest(policy=policy, label=policy)) \
            + call("Append", S0, pb.AppendRequest(seq_id=3, count=7))
    seeds["create-h2o"] = call("CreateSequence", S0, pb.CreateSequenceRequest(
        policy="h2o", params=params(budget=4, recent=2))) + call(
        "Append", S0, pb.AppendRequest(seq_id=3, count=7))
    return seeds


# fuzz_ring: struct ring_request (proto/kvstash_ring.h), little-endian, 64 bytes.
RING_REQ = struct.Struct("<IIQQqIIIIdQ")
FIX_SEQ, FIX_ACK, FIX_LEN = 1, 2, 4
PING, APPEND, STEP, EPOCH, REVIVE, RELEASE_SCRATCH, TABLE = 1, 2, 3, 4, 5, 6, 7
STEP_SCORE = 1


def ring_record(flags, op, count=0, arrays=0, data=b"", prefill=0, confidence=-1.0):
    req = RING_REQ.pack(op, arrays, 0, 0, count, 0, prefill, 1 if arrays else 0, 0, confidence, 0)
    return bytes([flags]) + req + struct.pack("<H", len(data)) + data


def ring_seeds():
    fix = FIX_SEQ | FIX_ACK | FIX_LEN
    # Session 1's h2o sequence holds 3 tokens a layer after the fixture; after
    # an append of 2, a score array of 5 floats per layer (2 layers).
    score = struct.pack("<10f", *[0.1 * i for i in range(10)])
    return {
        "ping": b"\x00" + ring_record(0, PING),
        "epoch": b"\x00" + ring_record(fix, EPOCH),
        "append": b"\x00" + ring_record(fix, APPEND, count=4),
        "append-step": b"\x01" + ring_record(fix, APPEND, count=2)
        + ring_record(fix, STEP, arrays=STEP_SCORE, data=score),
        "step-full": b"\x00" + ring_record(fix, STEP),
        "scribble": b"\x00" + ring_record(fix | 8 | 16, EPOCH) + ring_record(fix | 8, APPEND, count=1),
        "bad-op": b"\x00" + ring_record(0, 99),
        # ring_revive_request {layer, head, first, count, skip_evicted}; the
        # scratch id 1 of the first revive, released.
        "revive-release": b"\x00" + ring_record(fix, REVIVE, data=struct.pack("<5I", 0, 0, 0, 2, 0))
        + ring_record(fix, RELEASE_SCRATCH, data=struct.pack("<Q", 1)),
        # ring_table_request {with_positions, pad}, after an append.
        "append-table": b"\x00" + ring_record(fix, APPEND, count=3)
        + ring_record(fix, TABLE, data=struct.pack("<2I", 1, 0))
        + ring_record(fix, TABLE, data=struct.pack("<2I", 0, 0)),
    }


def fdsock_seeds():
    return {
        "hello": b"\x00HELLO 1",
        "hello-map-ring": b"\x00HELLO 1\nMAP 1\nRING\nRING",
        "twice": b"\x00HELLO 1\nHELLO 1",
        "unidentified": b"\x00MAP 1\nRING\nMAP x",
        "two-conns": b"\x01HELLO 1\nHELLO 1\nMAP 1\nMAP 2\nRING\n\nMAP 1",
        "garbage": b"\x00GET / HTTP/1.0\nMAP 18446744073709551616",
    }


def replay_seeds():
    seeds = {}
    d = os.path.join(ROOT, "docs", "replay")
    # The traces the docs and tests use, each under the policy it was made for.
    traces = {
        "h2o": ("--policy h2o --set budget=4 --set recent=2",
                [b'{"append": 4}', b'{"step": {"score": [[0.1, 0.5, 0.2, 0.9]]}}',
                 b'{"append": 2}', b'{"step": {"score": [[0.3, 0.1, 0.8, 0.2, 0.5, 0.4]]}}',
                 b'{"held": true}', b'{"state": true}']),
        "streaming": ("--policy streaming --set window=4 --set n_sink=1 --layers 2",
                      [b'{"append": 9}', b'{"step": {}}', b'{"held": true}']),
        "full": ("--policy full", [b'{"append": 3}', b'{"held": true}', b'{']),
        "usage": ("--layers 0 --policy full", [b'{"append": 1}']),
    }
    for name, (cmd, lines) in traces.items():
        seeds[name] = cmd.encode() + b"\n" + b"\n".join(lines) + b"\n"
    # Each policy's page in docs/replay/ shows its trace lines in code blocks.
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".md"):
            continue
        lines = [ln.strip().encode() for ln in open(os.path.join(d, fn))
                 if ln.strip().startswith("{") and ln.strip().endswith("}")]
        if lines:
            seeds["doc-" + fn[:-3]] = (f"--policy {fn[:-3]}\n".encode()
                                       + b"\n".join(lines[:40]) + b"\n")
    return seeds


def config_seeds():
    conf = open(os.path.join(ROOT, "ops", "kvstashd.conf"), "rb").read()
    return {
        "example-file": b"\x00" + conf,
        "file-small": b"\x00[kvstashd]\npool_mb = 64\nmax-sessions=8\nlisten = off\n"
                      b"operator_uids = 0,1000\nlog-level = debug\n",
        "flags": b"\x01pool-mb=64\nbackend=shadow\nmetrics=127.0.0.1:0\ndumpable=yes\n"
                 b"operator-uids=none\nmax-daemon-mb=0\n",
        "bad": b"\x00[other]\nx = 1\n[kvstashd]\npool_mb = -1\n",
    }


# fuzz_remote_value: [mode] then a value (daemon/remote_value.h): a 64-byte
# little-endian header, u32 positions, payload; CRC-32 at offset 60 over the
# whole value with those 4 bytes as zero. Mode bit 0: the target recomputes
# the checksum, so seeds with bit 0 set may carry a stale one.
RV_HEADER = struct.Struct("<4sHHBBBBIIIIIfIIIIQI")
TOKENS, SKETCH, MANIFEST = 1, 2, 3
T_FULL, T_INT8, T_SKETCH, T_INT4, T_INT2 = 0, 1, 2, 4, 5
FP16, BF16, FP32 = 1, 2, 3


def remote_value(kind, tier, positions=(), payload=b"", dtype=FP16, layer=1, head=0,
                 geom=(2, 4, 2, 8, 4, 10000.0), quant_group=0, crc=True):
    layers, q_heads, kv_heads, head_dim, block_tokens, theta = geom
    fields = [b"KVSR", 1, 64, kind, tier, dtype, 0, layers, q_heads, kv_heads, head_dim,
              block_tokens, theta, quant_group, layer, head, len(positions), len(payload), 0]
    body = struct.pack(f"<{len(positions)}I", *positions) + payload
    value = RV_HEADER.pack(*fields) + body
    if crc:
        fields[-1] = zlib.crc32(value)
        value = RV_HEADER.pack(*fields) + body
    return value


def remote_value_seeds():
    manifest = b'{"seq_uid":"0123456789abcdef0123456789abcdef","tokens":7}'
    seeds = {
        "full": remote_value(TOKENS, T_FULL, [0, 1, 2, 5], bytes(range(64))),
        "int8": remote_value(TOKENS, T_INT8, [3, 9], bytes(40), dtype=BF16),
        "int4": remote_value(TOKENS, T_INT4, [4, 5, 6], b"\x12" * 24, quant_group=32),
        "int2": remote_value(TOKENS, T_INT2, [7], b"\xe4" * 12, quant_group=2, dtype=FP32),
        "sketch": remote_value(SKETCH, T_SKETCH, [10, 11, 30], bytes(range(48))),
        "manifest": remote_value(MANIFEST, T_FULL, [], manifest, layer=0),
        "empty": remote_value(TOKENS, T_FULL),
        "truncated": remote_value(TOKENS, T_FULL, [0, 1, 2, 5], bytes(64))[:90],
        "stale-crc": remote_value(TOKENS, T_INT8, [1, 2], b"ab", crc=False),
        "descending": remote_value(TOKENS, T_FULL, [5, 4], b"", crc=False),
        "trailing": remote_value(SKETCH, T_SKETCH, [1], b"cell") + b"\x00",
    }
    # Byte 0 is the mode: 0 decodes as is, 1 reseals first.
    out = {name: b"\x00" + v for name, v in seeds.items()}
    for name in ("stale-crc", "descending"):
        out["reseal-" + name] = b"\x01" + seeds[name]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stubs", default=os.path.join(ROOT, "build", "tests", "py"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fuzz", "corpus"))
    a = ap.parse_args()
    sys.path.insert(0, a.stubs)
    from kvstash.v1 import store_pb2 as pb
    # `grpc` is grpcio's name: load the health stub from its file (as
    # tests/integration/kvstash_harness.py does).
    path = os.path.join(a.stubs, "grpc", "health", "v1", "health_pb2.py")
    spec = importlib.util.spec_from_file_location("kvstash_health_pb2", path)
    health_pb2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(health_pb2)

    all_seeds = {
        "fuzz_rpc": rpc_seeds(pb, health_pb2),
        "fuzz_ring": ring_seeds(),
        "fuzz_fdsock": fdsock_seeds(),
        "fuzz_replay": replay_seeds(),
        "fuzz_config": config_seeds(),
        "fuzz_remote_value": remote_value_seeds(),
    }
    for target, seeds in all_seeds.items():
        for name, data in seeds.items():
            write(a.out, target, name, data)
        print(f"{target}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
