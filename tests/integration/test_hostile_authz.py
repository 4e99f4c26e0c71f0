"""test_hostile_authz.py - issue 12, problem 3: one worker cannot act on or
look into another's cache, nor reach the pools without connecting.

  1. Worker B's Evict (and demote, offload, revive through it) on worker A's
     sequence is PERMISSION_DENIED and leaves A's sequence as it was, attached
     or not; A may on its own; an operator's uid (--operator-uids) may.
  2. Stats and Inspect from a session that is not an operator's show no other
     session's labels or parameters; a bad token is UNAUTHENTICATED; over TCP
     without a token only health answers.
  3. A process of the daemon's uid cannot open the daemon's pool memfd
     through /proc/<pid>/fd (PR_SET_DUMPABLE 0); with --dumpable it can, which
     shows the probe finds the memfd when it is reachable.
  4. Two tenants with one model and geometry get different pools and memfds;
     one tenant's workers share one; libkvstash takes $KVSTASH_TENANT.

The main daemon runs with --operator-uids set to a uid that is not the test's
(the test may run as root): its workers are not operators.
"""
import os
import socket
import subprocess
import sys

import grpc

from kvstash_harness import (SERVING, Daemon, Worker, call, expect_status, fd_hello, fd_request,
                             geometry, health_pb2, pb, pb_grpc, run_tests)
from worker_procs import WorkerProc

C = grpc.StatusCode
ME = os.geteuid()
OTHER_UID = 65534 if ME != 65534 else 65533  # "nobody": not the test's uid
TOKENS = 80
CLI_DENIED = 5  # kvstash's exit status for "permission denied"
SECRET = "tenant-a-secret-label"


def seq_tokens(daemon, w, seq_id):
    """Tokens of every list of w's sequence, and its epoch (GetBlockTable)."""
    t = call(daemon.store.GetBlockTable, pb.GetBlockTableRequest(seq_id=seq_id), w.md,
             "GetBlockTable")
    return [lt.tokens for lt in t.layers], t.epoch


def new_seq(daemon, w, label, tokens=TOKENS):
    req = pb.CreateSequenceRequest(policy="streaming", label=label,
                                   params=[pb.Param(key="window", value="4096")])
    seq_id = call(daemon.store.CreateSequence, req, w.md, "CreateSequence").seq_id
    call(daemon.store.Append, pb.AppendRequest(seq_id=seq_id, count=tokens), w.md, "Append")
    return seq_id


def evict_req(seq_id, to="", first=0, count=20):
    return pb.EvictRequest(seq_id=seq_id, to=to,
                           ranges=[pb.PositionRange(first=first, count=count)])


def setup(ctx):
    d = ctx.daemon
    ctx.a, ctx.b = Worker(d), Worker(d)
    ctx.a.attach(name="worker-a")
    ctx.b.attach(name="worker-b")
    ctx.workers = [ctx.a, ctx.b]
    ctx.seq_a = new_seq(d, ctx.a, SECRET)
    ctx.seq_b = new_seq(d, ctx.b, "worker-b-label", tokens=16)


# ---- 1. acting on another session's sequence ----------------------------------

def check_another_sessions_evict_is_denied(ctx):
    setup(ctx)
    d = ctx.daemon
    before = seq_tokens(d, ctx.a, ctx.seq_a)
    assert before[0] == [TOKENS] * len(before[0]), before
    # Evict, demote, offload and revive of A's positions by B, and by a
    # session that never attached (a bare HELLO, as the CLI does).
    bare_sock, bare_token = fd_hello(d.sock)
    try:
        for md in (ctx.b.md, (("kvstash-token", bare_token),)):
            for to in ("", "evict", "int8", "sketch", "full", "fp16"):
                msg = expect_status(d.store.Evict, evict_req(ctx.seq_a, to), C.PERMISSION_DENIED,
                                    md, f"Evict(to={to!r}) of another session's sequence")
                assert "operator_uids" in msg, msg
    finally:
        bare_sock.close()
    after = seq_tokens(d, ctx.a, ctx.seq_a)
    assert after == before, f"A's sequence changed under B's refused Evict: {before} -> {after}"
    # Every other call that names a sequence is the owner's alone.
    for name, req in (("GetBlockTable", pb.GetBlockTableRequest(seq_id=ctx.seq_a)),
                      ("Append", pb.AppendRequest(seq_id=ctx.seq_a, count=1)),
                      ("Revive", pb.ReviveRequest(seq_id=ctx.seq_a)),
                      ("ReleaseSequence", pb.ReleaseSequenceRequest(seq_id=ctx.seq_a))):
        expect_status(getattr(d.store, name), req, C.PERMISSION_DENIED, ctx.b.md,
                      f"{name} of another session's sequence")
    assert seq_tokens(d, ctx.a, ctx.seq_a) == before


def check_owner_evicts_its_own(ctx):
    d = ctx.daemon
    r = call(d.store.Evict, evict_req(ctx.seq_b, count=4), ctx.b.md, "Evict of its own")
    assert r.requested > 0 and r.evicted == r.requested, r
    tokens, _ = seq_tokens(d, ctx.b, ctx.seq_b)
    assert tokens == [12] * len(tokens), tokens


def check_operator_uid_may(ctx):
    d = Daemon(extra_args=["--operator-uids", str(ME)])
    d.start()
    try:
        a, op = Worker(d), Worker(d)
        a.attach(name="worker-a")
        seq = new_seq(d, a, SECRET)
        r = call(d.store.Evict, evict_req(seq), op.md, "an operator's Evict")
        assert r.evicted == r.requested and r.requested > 0, r
        tokens, _ = seq_tokens(d, a, seq)
        assert tokens == [TOKENS - 20] * len(tokens), tokens
        # An operator sees every label and inspects every sequence, and a call
        # without a token over the Unix socket (the CLI's) counts as the
        # daemon's uid: an operator's here.
        got = call(d.store.Inspect, pb.InspectRequest(seq_id=seq), op.md, "Inspect")
        assert got.sequence.label == SECRET, got.sequence
        assert SECRET in [q.label for q in d.stats().sequences]
        a.close()
        op.close()
    finally:
        d.stop()


# ---- 2. what a session that is no operator sees ---------------------------------

def check_stats_and_inspect_hide_other_sessions(ctx):
    d = ctx.daemon
    st = call(d.store.Stats, pb.StatsRequest(with_tiers=True), ctx.b.md, "Stats as B")
    assert [q.seq_id for q in st.sequences] == [ctx.seq_b], st.sequences
    assert SECRET not in str(st), "B's Stats shows A's label"
    assert [s.session_id for s in st.sessions] == [ctx.b.attached.session_id], st.sessions
    # The pools' totals still count A's blocks: aggregates, not details.
    (a_seq,) = call(d.store.Stats, pb.StatsRequest(), ctx.a.md, "Stats as A").sequences
    assert a_seq.label == SECRET, a_seq
    (pool,) = st.pools
    assert pool.blocks_used == a_seq.blocks + st.sequences[0].blocks, (pool, a_seq, st.sequences)
    assert pool.sessions == 2, pool
    msg = expect_status(d.store.Inspect, pb.InspectRequest(seq_id=ctx.seq_a, with_map=True),
                        C.PERMISSION_DENIED, ctx.b.md, "Inspect of A's sequence by B")
    assert SECRET not in msg
    own = call(d.store.Inspect, pb.InspectRequest(seq_id=ctx.seq_a), ctx.a.md, "Inspect as A")
    assert own.sequence.label == SECRET and {p.key for p in own.params} >= {"window"}, own
    # Without a token, over the Unix socket: the daemon's uid, no operator's.
    st = d.stats()
    assert list(st.sequences) == [] and list(st.sessions) == [], st
    expect_status(d.store.Inspect, pb.InspectRequest(seq_id=ctx.seq_a), C.PERMISSION_DENIED,
                  None, "Inspect without a token")
    bad = (("kvstash-token", "0" * 32),)
    for name, req in (("Stats", pb.StatsRequest()), ("Inspect", pb.InspectRequest(seq_id=1)),
                      ("ListPolicies", pb.ListPoliciesRequest())):
        expect_status(getattr(d.store, name), req, C.UNAUTHENTICATED, bad, f"{name}, bad token")


def run_cli(d, *args):
    cli = os.environ.get("KVSTASH_CLI")
    assert cli and os.access(cli, os.X_OK), f"KVSTASH_CLI={cli!r} (run through ctest)"
    return subprocess.run([cli, "--socket", d.sock, *args], capture_output=True, text=True,
                          timeout=30)


def check_cli_of_a_non_operator_sees_and_does_only_its_own(ctx):
    d = ctx.daemon
    p = run_cli(d, "--json", "seqs")
    assert p.returncode == 0 and SECRET not in p.stdout, (p.returncode, p.stdout, p.stderr)
    p = run_cli(d, "evict", str(ctx.seq_a), "0-9")
    assert p.returncode == CLI_DENIED and "permission denied" in p.stderr, (p.returncode, p.stderr)
    p = run_cli(d, "seq", "show", str(ctx.seq_a))
    assert p.returncode == CLI_DENIED and SECRET not in p.stdout + p.stderr, \
        (p.returncode, p.stdout, p.stderr)
    assert seq_tokens(d, ctx.a, ctx.seq_a)[0] == [TOKENS] * 2


def check_root_cli_is_an_operator_of_a_daemon_of_another_uid(ctx):
    # The isolating deployment: workers under kvstashd's uid, operator_uids =
    # root, `kvstash` run as root. Only root can play it.
    if ME != 0:
        print("skip: root cli: the test runs as uid", ME, "and cannot start a second uid")
        return
    d = Daemon(extra_args=["--operator-uids", "0"], **as_daemon_uid())
    os.chown(d.dir, OTHER_UID, OTHER_UID)
    d.start()
    try:
        a = Worker(d)
        a.attach(name="worker-a")
        seq = new_seq(d, a, SECRET)
        p = run_cli(d, "--json", "seqs")
        assert p.returncode == 0 and SECRET in p.stdout, (p.returncode, p.stdout, p.stderr)
        p = run_cli(d, "seq", "show", str(seq))
        assert p.returncode == 0 and SECRET in p.stdout, (p.returncode, p.stdout, p.stderr)
        p = run_cli(d, "evict", str(seq), "0-19")
        assert p.returncode == 0, (p.returncode, p.stderr)
        assert seq_tokens(d, a, seq)[0] == [TOKENS - 20] * 2
        a.close()
    finally:
        d.stop()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_tcp_without_a_token_sees_only_health(ctx):
    port = free_port()
    d = Daemon(extra_args=["--listen", f"127.0.0.1:{port}", "--operator-uids", str(OTHER_UID)])
    d.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        a = Worker(d)
        a.attach(name="worker-a")
        seq = new_seq(d, a, SECRET)
        tcp = pb_grpc.StoreStub(ch)
        health = ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        got = health(health_pb2.HealthCheckRequest(), timeout=5.0).status
        assert got == SERVING, f"health over TCP answered {got}"
        for name, req in (("Stats", pb.StatsRequest()),
                          ("Inspect", pb.InspectRequest(seq_id=seq)),
                          ("ListPolicies", pb.ListPoliciesRequest()),
                          ("GetBlockTable", pb.GetBlockTableRequest(seq_id=seq)),
                          ("Evict", evict_req(seq))):
            msg = expect_status(getattr(tcp, name), req, C.UNAUTHENTICATED, None,
                                f"{name} over TCP without a token")
            assert SECRET not in msg
        # With its session's token a worker reaches its own over TCP too.
        st = call(tcp.Stats, pb.StatsRequest(), a.md, "Stats over TCP with A's token")
        assert [q.label for q in st.sequences] == [SECRET], st.sequences
        a.close()
    finally:
        ch.close()
        d.stop()


# ---- 3. the pools are not reachable through /proc ------------------------------

# Prints "OPENED <n>" when /proc/<pid>/fd/<n> opens to the pool's inode,
# else "DENIED <how many opens were refused>" (listing the directory is
# refused too, then it tries every number below 1024).
PROBE = r"""
import os, sys
pid, ino = int(sys.argv[1]), int(sys.argv[2])
try:
    names = os.listdir(f"/proc/{pid}/fd")
except PermissionError:
    names = [str(n) for n in range(1024)]
denied = 0
for n in names:
    try:
        fd = os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY)
    except PermissionError:
        denied += 1
        continue
    except OSError:
        continue
    same = os.fstat(fd).st_ino == ino
    os.close(fd)
    if same:
        print("OPENED", n)
        sys.exit(0)
print("DENIED", denied)
"""


def as_daemon_uid():
    """Daemon args running it as a uid other than root when we are root (a
    root prober opens anything): nobody, in a directory it owns."""
    if ME != 0:
        return {}
    return {"wrapper": ("setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                        "--clear-groups", "--")}


def probe_pool_fd(extra_args):
    """Start a daemon, map its pool as a worker, and let a process of the
    daemon's uid try /proc/<daemon>/fd/N: its stdout."""
    d = Daemon(extra_args=extra_args, **as_daemon_uid())
    if ME == 0:
        os.chown(d.dir, OTHER_UID, OTHER_UID)
    d.start()
    try:
        w = Worker(d)
        att = w.attach(name="mapper")
        reply, fds = fd_request(w.fd_sock, f"MAP {att.pool_id}")
        assert reply.startswith("OK") and len(fds) == 1, reply
        ino = os.fstat(fds[0]).st_ino
        os.close(fds[0])
        kw = {"user": OTHER_UID, "group": OTHER_UID, "extra_groups": []} if ME == 0 else {}
        p = subprocess.run([sys.executable, "-c", PROBE, str(d.proc.pid), str(ino)],
                           capture_output=True, text=True, timeout=30, **kw)
        assert p.returncode == 0, p.stderr
        w.close()
        return p.stdout
    finally:
        d.stop()


def check_proc_fd_of_the_pool_is_closed_to_the_daemons_uid(ctx):
    out = probe_pool_fd([]).split()
    assert out[0] == "DENIED" and int(out[1]) > 0, \
        f"a process of kvstashd's uid opened its pool memfd through /proc: {out}"


def check_proc_probe_finds_a_dumpable_daemons_pool(ctx):
    # The control: the same probe opens the memfd of a --dumpable daemon, so
    # the check above cannot pass for want of finding it.
    out = probe_pool_fd(["--dumpable"]).split()
    assert out[0] == "OPENED", f"the probe did not find a --dumpable daemon's pool memfd: {out}"


# ---- 4. tenants ------------------------------------------------------------------

def pool_inode(w):
    reply, fds = fd_request(w.fd_sock, f"MAP {w.attached.pool_id}")
    assert reply.startswith("OK") and len(fds) == 1, reply
    ino = os.fstat(fds[0]).st_ino
    os.close(fds[0])
    return ino


def attach_tenant(d, tenant, name):
    w = Worker(d)
    req = pb.AttachRequest(model="shared", geometry=geometry(), worker_name=name, tenant=tenant)
    w.attached = call(d.store.Attach, req, w.md, f"Attach tenant {tenant!r}")
    return w


def check_two_tenants_get_two_pools(ctx):
    d = ctx.daemon
    x1, x2 = attach_tenant(d, "t1", "x1"), attach_tenant(d, "t1", "x2")
    y = attach_tenant(d, "t2", "y")
    try:
        assert x1.attached.pool_id == x2.attached.pool_id != y.attached.pool_id, \
            (x1.attached, x2.attached, y.attached)
        assert pool_inode(x1) == pool_inode(x2) != pool_inode(y)
        reply, fds = fd_request(y.fd_sock, f"MAP {x1.attached.pool_id}")
        assert reply.startswith("ERR") and not fds, f"t2 mapped t1's pool: {reply!r}"
        bad = Worker(d)
        req = pb.AttachRequest(model="shared", geometry=geometry(), tenant="no/slashes")
        expect_status(d.store.Attach, req, C.INVALID_ARGUMENT, bad.md, "Attach, bad tenant")
        bad.close()
    finally:
        for w in (x1, x2, y):
            w.close()


def check_libkvstash_takes_the_tenant_from_the_environment(ctx):
    d = Daemon(extra_args=["--operator-uids", str(ME)])
    d.start()
    old = os.environ.get("KVSTASH_TENANT")
    try:
        os.environ["KVSTASH_TENANT"] = "env-tenant"
        w = WorkerProc(d, "tenant-worker", seed=3, tokens=8, hold=True)
        os.environ.pop("KVSTASH_TENANT")
        v = WorkerProc(d, "default-worker", seed=4, tokens=8, hold=True)
        w.wait_line("READY")
        v.wait_line("READY")
        pools = {p.tenant: p for p in d.stats().pools}
        assert set(pools) == {"env-tenant", ""}, pools
        p = run_cli(d, "status")
        assert p.returncode == 0 and "tenant: env-tenant" in p.stdout, (p.stdout, p.stderr)
        w.finish()
        v.finish()
    finally:
        if old is not None:
            os.environ["KVSTASH_TENANT"] = old
        d.stop()


if __name__ == "__main__":
    sys.exit(run_tests("test_hostile_authz", [
        check_another_sessions_evict_is_denied,
        check_owner_evicts_its_own,
        check_operator_uid_may,
        check_stats_and_inspect_hide_other_sessions,
        check_tcp_without_a_token_sees_only_health,
        check_cli_of_a_non_operator_sees_and_does_only_its_own,
        check_root_cli_is_an_operator_of_a_daemon_of_another_uid,
        check_proc_fd_of_the_pool_is_closed_to_the_daemons_uid,
        check_proc_probe_finds_a_dumpable_daemons_pool,
        check_two_tenants_get_two_pools,
        check_libkvstash_takes_the_tenant_from_the_environment,
    ], daemon_kwargs={"extra_args": ["--operator-uids", str(OTHER_UID)]}, time_limit=120))
