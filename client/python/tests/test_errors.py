"""Every kvs_err path reachable from Python raises its class, with the code
and the daemon's (or libkvstash's) message (issue 13, acceptance 1)."""
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import kvstash
from kvstash import Geometry, Session

HERE = os.path.dirname(os.path.abspath(__file__))
GEO = Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=8, block_tokens=4)


def test_classes_carry_the_kvs_err_codes():
    codes = {kvstash.InvalidArgument: -1, kvstash.NotFound: -2, kvstash.PermissionDenied: -3,
             kvstash.FailedPrecondition: -4, kvstash.ResourceExhausted: -5,
             kvstash.Unavailable: -6, kvstash.ProtocolError: -7, kvstash.SystemError_: -8,
             kvstash.DataLoss: -9}
    for cls, code in codes.items():
        assert issubclass(cls, kvstash.KvstashError) and cls.code == code
        assert cls("m").code == code
    assert kvstash.errors.error_for(-99, "what").code == -99
    assert type(kvstash.errors.error_for(-5, "full")) is kvstash.ResourceExhausted


def test_invalid_argument_bad_count(daemon):
    with Session.attach("err-invalid", GEO, socket=daemon.sock) as s, s.create_sequence() as seq:
        for count in (0, -1, 1 << 20):
            with pytest.raises(kvstash.InvalidArgument) as e:
                seq.append(count)
            assert e.value.code == -1
            assert str(e.value) == (f"Append: count must be between 1 and 65536 tokens per "
                                    f"append, got {count}")
        with pytest.raises(kvstash.InvalidArgument, match="no-such-policy"):
            s.create_sequence("no-such-policy")


def test_not_found_unknown_sequence(daemon):
    with Session.attach("err-notfound", GEO, socket=daemon.sock) as s:
        ghost = kvstash.Sequence(s, 987654321, "full")
        for call in (lambda: ghost.append(1), ghost.table, ghost.epoch, ghost.release):
            with pytest.raises(kvstash.NotFound) as e:
                call()
            assert e.value.code == -2 and "987654321" in str(e.value), str(e.value)


def test_permission_another_sessions_sequence(daemon):
    with Session.attach("err-perm", GEO, socket=daemon.sock, worker_name="owner") as a, \
            Session.attach("err-perm", GEO, socket=daemon.sock, worker_name="thief") as b:
        assert a.pool_id == b.pool_id and a.id != b.id
        seq = a.create_sequence()
        seq.append(2)
        stolen = kvstash.Sequence(b, seq.id, "full")
        for call in (lambda: stolen.append(1), stolen.table, stolen.release,
                     lambda: stolen.step(new_tokens=1)):
            with pytest.raises(kvstash.PermissionDenied) as e:
                call()
            assert e.value.code == -3 and str(e.value), str(e.value)
        assert seq.append(1).first_position == 2  # the owner is unaffected


def test_precondition_geometry_mismatch(daemon):
    with Session.attach("err-geo", GEO, socket=daemon.sock):
        other = Geometry(layers=3, q_heads=4, kv_heads=2, head_dim=8, block_tokens=4)
        with pytest.raises(kvstash.FailedPrecondition) as e:
            Session.attach("err-geo", other, socket=daemon.sock)
        assert e.value.code == -4 and "geometry" in str(e.value).lower(), str(e.value)


def test_exhausted_beyond_a_tiny_pool(make_daemon):
    d = make_daemon(pool_mb=1)
    with Session.attach("err-full", GEO, socket=d.sock) as s, s.create_sequence() as seq:
        tokens_fit = s.block_count // GEO.layers * GEO.block_tokens
        with pytest.raises(kvstash.ResourceExhausted) as e:
            seq.append(tokens_fit + GEO.block_tokens)
        assert e.value.code == -5 and str(e.value).startswith("Append: "), str(e.value)
        # Nothing was taken: the whole pool still fits.
        assert seq.append(tokens_fit).lists[0].tokens == tokens_fit


def test_statistics_past_the_ring_name_ring_mb(make_daemon):
    """A step's statistics must fit the session's ring (--ring-mb): TOVA's
    last_attn of 8 query heads over 40,000 tokens is 1.22 MiB. Past a 1 MiB
    ring the step is refused before it is sent, saying what to raise, and the
    sequence is as before; a 2 MiB ring takes the same step."""
    geo = Geometry(layers=1, q_heads=8, kv_heads=1, head_dim=4, block_tokens=16)
    n, budget = 40000, 30000
    attn = [np.linspace(1, 2, n, dtype=np.float32)] * geo.q_heads
    small, large = make_daemon(extra_args=("--ring-mb", "1")), make_daemon(
        extra_args=("--ring-mb", "2"))
    with Session.attach("err-ring", geo, socket=small.sock) as s, \
            s.create_sequence("tova", {"budget": budget}) as seq:
        t = seq.append(n)
        with pytest.raises(kvstash.InvalidArgument) as e:
            seq.step(new_tokens=n, prefill=True, last_attn=attn)
        msg = str(e.value)
        assert "--ring-mb" in msg and f"({n * geo.q_heads * 4} bytes)" in msg, msg
        assert seq.epoch() == t.epoch and seq.table().lists[0].tokens == n
    with Session.attach("err-ring", geo, socket=large.sock) as s, \
            s.create_sequence("tova", {"budget": budget}) as seq:
        seq.append(n)
        r = seq.step(new_tokens=n, prefill=True, last_attn=attn)
        assert r.evicted == n - budget
        # linspace scores: the lowest positions go first.
        assert seq.table().lists[0].positions.min() == n - budget


def test_unavailable_no_daemon():
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "nobody.sock")
        with pytest.raises(kvstash.Unavailable) as e:
            Session.attach("m", GEO, socket=sock)
        assert e.value.code == -6 and "is kvstashd running?" in str(e.value), str(e.value)
        with pytest.raises(kvstash.Unavailable):
            kvstash.stats(sock)


def test_unavailable_after_the_daemon_stopped(make_daemon):
    d = make_daemon()
    s = Session.attach("err-gone", GEO, socket=d.sock)
    seq = s.create_sequence()
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(kvstash.Unavailable, match="no answer from kvstashd on the session's ring"):
        seq.append(1)
    with pytest.raises(kvstash.Unavailable):
        s.detach()
    d.proc = None  # nothing left to stop


def attach_to_fake_daemon(mode, cls):
    """Session.attach against tests' fake_kvstashd.py in `mode`: the error
    it raises, which must be a `cls`."""
    tmp = tempfile.mkdtemp(prefix="kvstash-fake.")
    sock = os.path.join(tmp, "fake.sock")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_kvstashd.py"), sock, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", (line, proc.poll(), proc.stderr.read())
        with pytest.raises(cls) as e:
            Session.attach("m", GEO, socket=sock)
        return e.value
    finally:
        proc.kill()
        proc.wait()


def test_protocol_unexpected_grpc_status():
    e = attach_to_fake_daemon("aborted", kvstash.ProtocolError)
    assert e.code == -7
    assert "gave up (ABORTED on purpose)" in str(e), str(e)


def test_data_loss():
    e = attach_to_fake_daemon("data-loss", kvstash.DataLoss)
    assert e.code == -9
    assert "the pool went missing (DATA_LOSS on purpose)" in str(e), str(e)


def test_system_pool_cannot_be_mapped():
    e = attach_to_fake_daemon("readonly-pool", kvstash.SystemError_)
    assert e.code == -8
    assert str(e).startswith("mmap of the ") and "Permission denied" in str(e), str(e)


def test_unsupported_pool_views_on_the_shadow_backend(make_daemon):
    d = make_daemon(backend="shadow")
    with Session.attach("err-shadow", GEO, socket=d.sock) as s, s.create_sequence() as seq:
        assert s.backend == "shadow"
        with pytest.raises(kvstash.Unsupported, match="shadow"):
            s.block_keys(0)
        # Copies through libkvstash's ops still work there.
        lst = seq.append(3).lists[1]
        k = np.arange(48, dtype=np.float32).reshape(2, 3, 8)
        seq.write(lst, k, k + 1)
        got_k, got_v = seq.read(seq.table().list(1))
        assert np.array_equal(got_k, k) and np.array_equal(got_v, k + 1)


def test_library_not_found_lists_what_it_tried(tmp_path):
    """A copy of the package with no library beside it, outside the build
    tree, and KVSTASH_LIB pointing nowhere."""
    import shutil
    pkg = tmp_path / "kvstash"
    shutil.copytree(os.path.join(HERE, "..", "kvstash"), pkg,
                    ignore=shutil.ignore_patterns("llama", "__pycache__", "*.so"))
    code = ("import kvstash\n"
            "try:\n"
            "    kvstash.stats('/nonexistent')\n"
            "except OSError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, KVSTASH_LIB=str(tmp_path / "missing.so"), PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert "cannot load libkvstash.so; tried:" in msg, msg
    assert str(tmp_path / "missing.so") + " (no such file)" in msg
    assert str(pkg / "libkvstash.so") + " (no such file)" in msg
    assert "KVSTASH_LIB" in msg
