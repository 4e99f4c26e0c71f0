"""test_wire.py - kvstashd spoken to by an independent implementation.

Python's grpcio and protobuf (stubs from Debian's protoc + grpc_python_plugin)
against the daemon's gRPC C core + protobuf-c: health, stats, the fd-socket
handshake and pool mapping of docs/protocol.md, Attach and Lease, sequence
creation with bad policies and parameters (which must change nothing), one
sequence's full life, and unknown methods.
"""
import fcntl
import mmap
import os
import socket
import stat
import sys

import grpc

from kvstash_harness import (SERVING, Worker, call, expect_status, fd_request, geometry,
                             health_pb2, pb, run_tests)

C = grpc.StatusCode
GEOM = dict(layers=2, q_heads=4, kv_heads=2, head_dim=8, dtype=pb.DTYPE_FP32, block_tokens=16)
BLOCK_BYTES = 2 * GEOM["kv_heads"] * GEOM["block_tokens"] * GEOM["head_dim"] * 4


def check_health_server(ctx):
    st = ctx.daemon.health("")
    assert st == SERVING, f"Health/Check(''): {health_pb2.HealthCheckResponse.ServingStatus.Name(st)}"


def check_health_store(ctx):
    st = ctx.daemon.health("kvstash.v1.Store")
    assert st == SERVING, f"Health/Check('kvstash.v1.Store'): status {st}"


def check_health_unknown_service(ctx):
    expect_status(ctx.daemon.check_method(),
                  health_pb2.HealthCheckRequest(service="no.such.Service"), C.NOT_FOUND,
                  what="Health/Check('no.such.Service')")


def check_stats_fresh(ctx):
    s = ctx.daemon.stats()
    assert s.version, "Stats.version is empty"
    assert s.backend == ctx.daemon.backend, \
        f"Stats.backend = {s.backend!r}, expected {ctx.daemon.backend!r}"
    # Host memory (host, shadow): no device, a memfd (issue 14).
    assert (s.device, s.device_name, s.ipc) == ("none", "", "memfd"), \
        f"Stats device {s.device!r} ({s.device_name!r}), ipc {s.ipc!r}"
    for p in ("full", "streaming"):
        assert p in s.policies, f"Stats.policies {list(s.policies)} lacks {p!r}"
    assert not s.sequences and not s.sessions and not s.pools, \
        f"fresh daemon has state: {len(s.pools)} pools, {len(s.sessions)} sessions, " \
        f"{len(s.sequences)} sequences"


def check_socket_modes(ctx):
    for path in (ctx.daemon.sock, ctx.daemon.sock + ".fd"):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode), f"{path} is not a socket"
        mode = stat.S_IMODE(st.st_mode)
        assert mode & 0o077 == 0, f"{path} has mode {mode:o}; group/other must have no access"


def check_fd_socket_bad_then_hello(ctx):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    try:
        s.connect(ctx.daemon.sock + ".fd")
        reply, fds = fd_request(s, "NOPE 7")
        assert reply.startswith("ERR"), f"'NOPE 7' answered {reply!r}, expected 'ERR <reason>'"
        assert not fds, "an ERR reply carried file descriptors"
        reply, _ = fd_request(s, "MAP 1")
        assert reply.startswith("ERR"), f"MAP before HELLO/Attach answered {reply!r}"
        reply, _ = fd_request(s, "HELLO 1")
        assert reply.startswith("OK ") and len(reply.split()[1]) == 32, \
            f"HELLO 1 after errors answered {reply!r}: the connection must stay usable"
    finally:
        s.close()


def check_attach(ctx):
    w = Worker(ctx.daemon)
    ctx.workers = [w]
    ctx.w = w
    r = w.attach("wire", geometry(**GEOM), name="wire-test", lease=False)
    assert r.session_id > 0, f"Attach: session_id {r.session_id}"
    assert r.pool_id > 0, f"Attach: pool_id {r.pool_id}"
    assert r.backend == ctx.daemon.backend, f"Attach: backend {r.backend!r}"
    assert r.pool_bytes > 0, f"Attach: pool_bytes {r.pool_bytes}"
    assert r.block_bytes == BLOCK_BYTES, f"Attach: block_bytes {r.block_bytes}, expected {BLOCK_BYTES}"
    assert r.block_count > 0 and r.block_count * r.block_bytes <= r.pool_bytes, \
        f"Attach: {r.block_count} blocks of {r.block_bytes} B do not fit {r.pool_bytes} B"
    g = r.geometry
    got = dict(layers=g.layers, q_heads=g.q_heads, kv_heads=g.kv_heads, head_dim=g.head_dim,
               dtype=g.dtype, block_tokens=g.block_tokens)
    assert got == GEOM, f"Attach: geometry {got}, expected {GEOM}"
    assert g.rope_theta == 10000.0, f"Attach: rope_theta default not filled in: {g.rope_theta}"


def check_lease_granted(ctx):
    m = ctx.w.open_lease()
    assert m.state == "granted", f"Lease: first message state {m.state!r}"
    assert m.session_id == ctx.w.attached.session_id, \
        f"Lease: session {m.session_id}, Attach said {ctx.w.attached.session_id}"


def check_map_pool(ctx):
    r = ctx.w.attached
    reply, fds = fd_request(ctx.w.fd_sock, f"MAP {r.pool_id}")
    try:
        assert reply.split() == ["OK", str(r.pool_bytes)], \
            f"MAP {r.pool_id} answered {reply!r}, expected 'OK {r.pool_bytes}'"
        assert len(fds) == 1, f"MAP carried {len(fds)} fds, expected 1"
        fd = fds[0]
        assert os.fstat(fd).st_size == r.pool_bytes, \
            f"pool fd size {os.fstat(fd).st_size} != pool_bytes {r.pool_bytes}"
        seals = fcntl.fcntl(fd, getattr(fcntl, "F_GET_SEALS", 1034))
        want = 0x0002 | 0x0004 | 0x0001  # F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
        assert seals & want == want, f"pool memfd seals {seals:#x}, expected {want:#x} set"
        try:
            os.ftruncate(fd, 4096)
            raise AssertionError("a worker could shrink the pool memfd")
        except PermissionError:
            pass
        with mmap.mmap(fd, r.pool_bytes) as m:  # a worker can write K/V in place
            m[0:4] = b"kvst"
            assert m[0:4] == b"kvst"
            m[0:4] = b"\0\0\0\0"
        reply, fds2 = fd_request(ctx.w.fd_sock, f"MAP {r.pool_id + 1000}")
        fds += fds2
        assert reply.startswith("ERR"), f"MAP of a pool not attached answered {reply!r}"
    finally:
        for fd in fds:
            os.close(fd)


def check_stats_after_attach(ctx):
    s = ctx.daemon.stats()
    r = ctx.w.attached
    assert [p.model for p in s.pools] == ["wire"], f"Stats.pools: {[p.model for p in s.pools]}"
    p = s.pools[0]
    assert p.pool_id == r.pool_id and p.blocks_total == r.block_count, \
        f"Stats pool {p.pool_id}/{p.blocks_total} blocks, Attach said {r.pool_id}/{r.block_count}"
    assert p.blocks_free == p.blocks_total and p.blocks_used == 0, \
        f"fresh pool: free {p.blocks_free} used {p.blocks_used} of {p.blocks_total}"
    sess = [x for x in s.sessions if x.session_id == r.session_id]
    assert sess, f"Stats.sessions lacks session {r.session_id}"
    assert sess[0].pid == os.getpid(), f"session pid {sess[0].pid}, this process is {os.getpid()}"
    assert sess[0].uid == os.getuid(), f"session uid {sess[0].uid}"
    assert sess[0].worker_name == "wire-test", f"session worker_name {sess[0].worker_name!r}"
    assert sess[0].lease_open, "session lease_open is false with the Lease stream open"
    ctx.stats_before = s


def check_create_unknown_policy(ctx):
    d = expect_status(ctx.daemon.store.CreateSequence, pb.CreateSequenceRequest(policy="nope"),
                      C.INVALID_ARGUMENT, ctx.w.md, "CreateSequence(policy=nope)")
    assert "nope" in d, f"details do not name the policy: {d!r}"


def check_create_bad_parameter(ctx):
    req = pb.CreateSequenceRequest(policy="streaming", params=[pb.Param(key="window", value="abc")])
    d = expect_status(ctx.daemon.store.CreateSequence, req, C.INVALID_ARGUMENT, ctx.w.md,
                      "CreateSequence(streaming, window=abc)")
    assert "window" in d, f"details do not name the parameter: {d!r}"


def check_create_unknown_parameter(ctx):
    req = pb.CreateSequenceRequest(policy="full", params=[pb.Param(key="frobnicate", value="1")])
    d = expect_status(ctx.daemon.store.CreateSequence, req, C.INVALID_ARGUMENT, ctx.w.md,
                      "CreateSequence(full, frobnicate=1)")
    assert "frobnicate" in d, f"details do not name the unknown key: {d!r}"


def check_stats_unchanged_after_bad_calls(ctx):
    s = ctx.daemon.stats()
    b = ctx.stats_before
    assert not s.sequences, f"bad CreateSequence calls left {len(s.sequences)} sequences"
    assert [(p.pool_id, p.blocks_free, p.blocks_used) for p in s.pools] == \
        [(p.pool_id, p.blocks_free, p.blocks_used) for p in b.pools], "pool usage changed"
    assert [(x.session_id, x.sequences) for x in s.sessions] == \
        [(x.session_id, x.sequences) for x in b.sessions], "sessions changed"


def check_sequence_life(ctx):
    st, md = ctx.daemon.store, ctx.w.md
    c = call(st.CreateSequence, pb.CreateSequenceRequest(policy="full", label="wire-seq"), md,
             "CreateSequence(full)")
    assert c.seq_id > 0, f"seq_id {c.seq_id}"
    a = call(st.Append, pb.AppendRequest(seq_id=c.seq_id, count=20), md, "Append(20)")
    assert a.first_position == 0, f"first append: first_position {a.first_position}"
    assert a.epoch > c.epoch, f"Append did not bump the epoch ({c.epoch} -> {a.epoch})"
    assert sorted(x.layer for x in a.writes) == [0, 1], f"writes for layers {[x.layer for x in a.writes]}"
    for lt in a.writes:
        assert len(lt.block) == len(lt.first_slot) == len(lt.count), "ragged segment arrays"
        assert sum(lt.count) == 20, f"layer {lt.layer}: segments hold {sum(lt.count)} of 20 tokens"
        for fs, n in zip(lt.first_slot, lt.count):
            assert fs + n <= GEOM["block_tokens"], f"segment slots {fs}+{n} overflow a block"
    a2 = call(st.Append, pb.AppendRequest(seq_id=c.seq_id, count=5, ack_epoch=a.epoch), md,
              "Append(5)")
    assert a2.first_position == 20, f"second append: first_position {a2.first_position}"
    t = call(st.GetBlockTable, pb.GetBlockTableRequest(seq_id=c.seq_id, with_positions=True), md,
             "GetBlockTable")
    assert t.epoch == a2.epoch, f"table epoch {t.epoch}, last append said {a2.epoch}"
    for lt in t.layers:
        assert lt.tokens == 25, f"layer {lt.layer}: {lt.tokens} tokens, expected 25"
        assert list(lt.positions) == list(range(25)), f"layer {lt.layer}: positions {list(lt.positions)}"
        blocks = set(lt.block)
        assert len(blocks) == 2, f"layer {lt.layer}: 25 tokens in {len(blocks)} blocks of 16"
    i = call(st.Inspect, pb.InspectRequest(seq_id=c.seq_id), None, "Inspect (no token)")
    assert i.sequence.policy == "full" and i.sequence.label == "wire-seq", \
        f"Inspect: policy {i.sequence.policy!r} label {i.sequence.label!r}"
    assert i.sequence.appended == 25, f"Inspect: appended {i.sequence.appended}"
    r = call(st.ReleaseSequence, pb.ReleaseSequenceRequest(seq_id=c.seq_id), md, "ReleaseSequence")
    assert r.blocks_freed == 4, f"ReleaseSequence freed {r.blocks_freed} blocks, expected 4"
    s = ctx.daemon.stats()
    assert not s.sequences, "released sequence still in Stats"
    assert s.pools[0].blocks_free == s.pools[0].blocks_total, \
        f"after release {s.pools[0].blocks_free} of {s.pools[0].blocks_total} blocks free"
    expect_status(st.GetBlockTable, pb.GetBlockTableRequest(seq_id=c.seq_id), C.NOT_FOUND, md,
                  "GetBlockTable of a released sequence")


def check_unknown_method(ctx):
    expect_status(ctx.daemon.raw_method("/kvstash.v1.Store/NoSuchMethod"), b"",
                  C.UNIMPLEMENTED, what="/kvstash.v1.Store/NoSuchMethod")
    expect_status(ctx.daemon.raw_method("/kvstash.v9.Nothing/Here"), b"\x08\x01",
                  C.UNIMPLEMENTED, what="/kvstash.v9.Nothing/Here")


def check_still_serving(ctx):
    assert ctx.daemon.health("") == SERVING, "daemon no longer SERVING"


def check_no_error_logged(ctx):
    errors = [ln for ln in ctx.daemon.log().splitlines() if "level=error" in ln]
    assert not errors, "daemon logged errors:\n" + "\n".join(errors[:10])


CHECKS = [
    check_health_server, check_health_store, check_health_unknown_service, check_stats_fresh,
    check_socket_modes, check_fd_socket_bad_then_hello, check_attach, check_lease_granted,
    check_map_pool, check_stats_after_attach, check_create_unknown_policy,
    check_create_bad_parameter, check_create_unknown_parameter,
    check_stats_unchanged_after_bad_calls, check_sequence_life, check_unknown_method,
    check_still_serving, check_no_error_logged,
]

if __name__ == "__main__":
    sys.exit(run_tests("test_wire", CHECKS))
