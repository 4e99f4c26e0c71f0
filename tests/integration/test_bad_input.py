"""test_bad_input.py - bad requests get precise statuses and change nothing.

One worker attaches (model "wire") and holds one sequence with 5 tokens. Then
every kind of bad request is thrown at the daemon over the wire: unknown ids,
counts out of range, a pool that cannot hold the request, geometry that does
not match or makes no sense, missing or foreign tokens, and bytes that are
not protobuf. Afterwards the daemon must still serve, the one sequence must
be exactly as it was, and the daemon must not have logged an error.
"""
import sys

import grpc

from kvstash_harness import (SERVING, Worker, call, expect_status, geometry, pb, run_tests)

C = grpc.StatusCode
GARBAGE = b"\xff\xff\xff\x07garbage"


def seq_view(s, seq_id):
    """The fields of one sequence in a StatsResponse that must not change."""
    for q in s.sequences:
        if q.seq_id == seq_id:
            return dict(session=q.session_id, policy=q.policy, epoch=q.epoch,
                        appended=q.appended, tokens=q.tokens, blocks=q.blocks, bytes=q.bytes)
    return None


def pool_view(s):
    return [(p.pool_id, p.model, p.blocks_total, p.blocks_free, p.blocks_used, p.blocks_retired)
            for p in s.pools]


def check_setup_one_sequence(ctx):
    w = Worker(ctx.daemon)
    ctx.workers = [w]
    ctx.a = w
    ctx.att = w.attach("wire", geometry(), name="bad-input-a")
    c = call(ctx.daemon.store.CreateSequence, pb.CreateSequenceRequest(policy="full", label="keep"),
             w.md, "CreateSequence(full)")
    ctx.seq = c.seq_id
    a = call(ctx.daemon.store.Append, pb.AppendRequest(seq_id=ctx.seq, count=5), w.md, "Append(5)")
    ctx.table_before = call(ctx.daemon.store.GetBlockTable,
                            pb.GetBlockTableRequest(seq_id=ctx.seq, with_positions=True,
                                                    ack_epoch=a.epoch), w.md, "GetBlockTable")
    ctx.before = ctx.daemon.stats()
    v = seq_view(ctx.before, ctx.seq)
    assert v is not None, f"Stats lacks sequence {ctx.seq}"
    assert v["appended"] == 5 and v["tokens"] == 10, f"sequence after Append(5): {v}"


def check_append_unknown_sequence(ctx):
    d = expect_status(ctx.daemon.store.Append, pb.AppendRequest(seq_id=ctx.seq + 999999, count=1),
                      C.NOT_FOUND, ctx.a.md, "Append to an unknown seq_id")
    assert d, "NOT_FOUND without a message"


def check_append_count_zero_and_negative(ctx):
    for n in (0, -5, -(2**63)):
        d = expect_status(ctx.daemon.store.Append, pb.AppendRequest(seq_id=ctx.seq, count=n),
                          C.INVALID_ARGUMENT, ctx.a.md, f"Append count={n}")
        assert "count" in d.lower(), f"Append count={n}: details do not name 'count': {d!r}"


def check_append_huge_count(ctx):
    for n in (10**12, 2**31, 2**32 + 1, 65537):
        try:
            ctx.daemon.store.Append(pb.AppendRequest(seq_id=ctx.seq, count=n), timeout=5,
                                    metadata=ctx.a.md)
        except grpc.RpcError as e:
            assert e.code() in (C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED), \
                f"Append count={n}: {e.code().name}: {e.details()!r}"
            d = (e.details() or "").lower()
            assert "count" in d or "block" in d, \
                f"Append count={n}: details mention neither count nor blocks: {e.details()!r}"
            continue
        raise AssertionError(f"Append count={n} succeeded")


def check_append_beyond_pool(ctx):
    bt = ctx.att.geometry.block_tokens
    layers = ctx.att.geometry.layers
    free = ctx.before.pools[0].blocks_free
    n = 65536  # the largest count allowed
    room = bt - 5  # free slots left in the block that holds the first 5 tokens
    need = layers * -(-(n - room) // bt)
    assert need > free, f"test setup: {n} tokens need {need} blocks, pool has {free} free"
    d = expect_status(ctx.daemon.store.Append, pb.AppendRequest(seq_id=ctx.seq, count=n),
                      C.RESOURCE_EXHAUSTED, ctx.a.md, f"Append count={n} into a small pool")
    assert "block" in d.lower() or "pool" in d.lower(), f"details: {d!r}"


def check_geometry_mismatch(ctx):
    w = Worker(ctx.daemon)
    ctx.workers.append(w)
    req = pb.AttachRequest(model="wire", geometry=geometry(kv_heads=1), worker_name="mismatch")
    d = expect_status(ctx.daemon.store.Attach, req, C.FAILED_PRECONDITION, w.md,
                      "Attach 'wire' with kv_heads 1 (pool has 2)")
    assert "geometry" in d.lower() or "kv_heads" in d.lower(), \
        f"details do not mention the geometry: {d!r}"


def check_invalid_geometry(ctx):
    cases = [
        ("q_heads 3 over kv_heads 2", geometry(q_heads=3, kv_heads=2), "q_heads"),
        ("head_dim 0", geometry(head_dim=0), "head_dim"),
        ("dtype unspecified", geometry(dtype=pb.DTYPE_UNSPECIFIED), "dtype"),
        ("layers 0", geometry(layers=0), "layers"),
        ("block_tokens 5000", geometry(block_tokens=5000), "block_tokens"),
        ("kv_heads 0", geometry(q_heads=4, kv_heads=0), "kv_heads"),
        ("no geometry", None, "geometry"),
    ]
    for i, (what, g, field) in enumerate(cases):
        w = Worker(ctx.daemon)
        ctx.workers.append(w)
        req = pb.AttachRequest(model=f"bad-geom-{i}", worker_name="bad")
        if g is not None:
            req.geometry.CopyFrom(g)
        d = expect_status(ctx.daemon.store.Attach, req, C.INVALID_ARGUMENT, w.md,
                          f"Attach with {what}")
        assert field in d, f"Attach with {what}: details do not name {field!r}: {d!r}"


def check_invalid_names(ctx):
    w = Worker(ctx.daemon)
    ctx.workers.append(w)
    for model in ("bad name!", "", "m" * 65, "../etc"):
        d = expect_status(ctx.daemon.store.Attach,
                          pb.AttachRequest(model=model, geometry=geometry(), worker_name="x"),
                          C.INVALID_ARGUMENT, w.md, f"Attach model={model!r}")
        assert "model" in d, f"Attach model={model!r}: details do not name 'model': {d!r}"
    d = expect_status(ctx.daemon.store.CreateSequence,
                      pb.CreateSequenceRequest(policy="full", label="x" * 200),
                      C.INVALID_ARGUMENT, ctx.a.md, "CreateSequence with a 200-byte label")
    assert "label" in d, f"details do not name 'label': {d!r}"


def check_invalid_utf8_strings(ctx):
    # proto3 strings must be valid UTF-8: a daemon that stores such bytes and
    # echoes them in Stats makes Stats undecodable for every strict client.
    w = Worker(ctx.daemon)
    ctx.workers.append(w)
    attach = pb.AttachRequest(model="wire", geometry=geometry()).SerializeToString()
    attach += b"\x1a\x02\xff\xfe"  # field 3, worker_name: two bytes that are not UTF-8
    create = pb.CreateSequenceRequest(policy="full").SerializeToString()
    create += b"\x1a\x02\xc3\x28"  # field 3, label: a truncated UTF-8 sequence
    problems = []
    for method, req, md, field in (("Attach", attach, w.md, "worker_name"),
                                   ("CreateSequence", create, ctx.a.md, "label")):
        try:
            resp = ctx.daemon.raw_method(f"/kvstash.v1.Store/{method}")(req, timeout=5, metadata=md)
        except grpc.RpcError as e:
            if e.code() != C.INVALID_ARGUMENT or field not in (e.details() or ""):
                problems.append(f"{method} with a non-UTF-8 {field}: {e.code().name}: "
                                f"{e.details()!r} (expected INVALID_ARGUMENT naming {field!r})")
            continue
        problems.append(f"{method} accepted a non-UTF-8 {field}")
        if method == "CreateSequence":  # undo, so that later checks still mean something
            seq = pb.CreateSequenceResponse.FromString(resp).seq_id
            call(ctx.daemon.store.ReleaseSequence, pb.ReleaseSequenceRequest(seq_id=seq), md)
    w.close()  # ends the session if the Attach went through
    ctx.workers.remove(w)
    assert not problems, "; ".join(problems)


def check_client_text_cannot_forge_log_lines(ctx):
    forged = 'nope" x=1\nforged_by_client=1 level=info msg=fake'
    expect_status(ctx.daemon.store.CreateSequence, pb.CreateSequenceRequest(policy=forged),
                  C.INVALID_ARGUMENT, ctx.a.md, "CreateSequence with a newline in the policy")
    bad = [ln for ln in ctx.daemon.log().splitlines() if not ln.startswith("ts=")]
    assert not bad, "client text broke the log's one-line-per-event format:\n" + "\n".join(bad[:5])


def check_no_pools_from_failed_attaches(ctx):
    s = ctx.daemon.stats()
    models = [p.model for p in s.pools]
    assert models == ["wire"], f"failed Attach calls created pools: {models}"


def check_missing_or_bad_token(ctx):
    st = ctx.daemon.store
    expect_status(st.CreateSequence, pb.CreateSequenceRequest(policy="full"), C.UNAUTHENTICATED,
                  None, "CreateSequence without a token")
    expect_status(st.Append, pb.AppendRequest(seq_id=ctx.seq, count=1), C.UNAUTHENTICATED, None,
                  "Append without a token")
    expect_status(st.Attach, pb.AttachRequest(model="wire", geometry=geometry()),
                  C.UNAUTHENTICATED, None, "Attach without a token")
    for tok in ("0" * 32, "not-a-token", ctx.a.token[:31]):
        expect_status(st.CreateSequence, pb.CreateSequenceRequest(policy="full"),
                      C.UNAUTHENTICATED, (("kvstash-token", tok),),
                      f"CreateSequence with token {tok!r}")


def check_not_attached(ctx):
    w = Worker(ctx.daemon)
    ctx.workers.append(w)
    expect_status(ctx.daemon.store.CreateSequence, pb.CreateSequenceRequest(policy="full"),
                  C.FAILED_PRECONDITION, w.md, "CreateSequence before Attach")


def check_other_sessions_sequence(ctx):
    w = Worker(ctx.daemon)
    ctx.workers.append(w)
    ctx.c = w
    w.attach("wire", geometry(), name="bad-input-c")
    st = ctx.daemon.store
    expect_status(st.Append, pb.AppendRequest(seq_id=ctx.seq, count=1), C.PERMISSION_DENIED,
                  w.md, "Append to another session's sequence")
    expect_status(st.GetBlockTable, pb.GetBlockTableRequest(seq_id=ctx.seq),
                  C.PERMISSION_DENIED, w.md, "GetBlockTable of another session's sequence")
    expect_status(st.ReleaseSequence, pb.ReleaseSequenceRequest(seq_id=ctx.seq),
                  C.PERMISSION_DENIED, w.md, "ReleaseSequence of another session's sequence")


def check_garbage_bytes(ctx):
    for m in ("Append", "CreateSequence", "GetBlockTable", "ReleaseSequence"):
        expect_status(ctx.daemon.raw_method(f"/kvstash.v1.Store/{m}"), GARBAGE,
                      C.INVALID_ARGUMENT, ctx.a.md, f"{m} with garbage bytes")
    w = Worker(ctx.daemon)
    ctx.workers.append(w)
    expect_status(ctx.daemon.raw_method("/kvstash.v1.Store/Attach"), GARBAGE,
                  C.INVALID_ARGUMENT, w.md, "Attach with garbage bytes")


def check_daemon_alive(ctx):
    assert ctx.daemon.health("") == SERVING, "daemon no longer SERVING"
    assert ctx.daemon.health("kvstash.v1.Store") == SERVING, "store no longer SERVING"


def check_sequence_unchanged(ctx):
    s = ctx.daemon.stats()
    assert [q.seq_id for q in s.sequences] == [ctx.seq], \
        f"Stats sequences {[q.seq_id for q in s.sequences]}, expected only {ctx.seq}"
    before, after = seq_view(ctx.before, ctx.seq), seq_view(s, ctx.seq)
    assert after == before, f"sequence changed:\n before {before}\n after  {after}"
    assert pool_view(s) == pool_view(ctx.before), \
        f"pool changed:\n before {pool_view(ctx.before)}\n after  {pool_view(s)}"
    t = call(ctx.daemon.store.GetBlockTable,
             pb.GetBlockTableRequest(seq_id=ctx.seq, with_positions=True), ctx.a.md,
             "GetBlockTable")
    assert t == ctx.table_before, f"block table changed:\n{ctx.table_before}\n->\n{t}"


def check_sequence_still_usable(ctx):
    a = call(ctx.daemon.store.Append, pb.AppendRequest(seq_id=ctx.seq, count=1), ctx.a.md,
             "Append(1) after the bad calls")
    assert a.first_position == 5, f"first_position {a.first_position}, expected 5"


def check_no_error_logged(ctx):
    errors = [ln for ln in ctx.daemon.log().splitlines() if "level=error" in ln]
    assert not errors, "daemon logged errors for client mistakes:\n" + "\n".join(errors[:10])


CHECKS = [
    check_setup_one_sequence, check_append_unknown_sequence, check_append_count_zero_and_negative,
    check_append_huge_count, check_append_beyond_pool, check_geometry_mismatch,
    check_invalid_geometry, check_invalid_names, check_invalid_utf8_strings,
    check_client_text_cannot_forge_log_lines, check_no_pools_from_failed_attaches,
    check_missing_or_bad_token, check_not_attached, check_other_sessions_sequence,
    check_garbage_bytes, check_daemon_alive, check_sequence_unchanged,
    check_sequence_still_usable, check_no_error_logged,
]

if __name__ == "__main__":
    sys.exit(run_tests("test_bad_input", CHECKS))
