"""The package's API against a real kvstashd (issue 13, acceptance 1):
attach and the pool's shape, append / write / read byte for byte, step with
statistics (checked before sending), table and epoch, revive, release,
detach, context managers, stats."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvstash
from kvstash import Geometry, Session

GEO = Geometry(layers=3, q_heads=4, kv_heads=2, head_dim=8, block_tokens=4, dtype="fp32")
CLI = os.environ.get("KVSTASH_CLI") or os.path.join(os.environ["KVSTASH_BUILD_DIR"], "client",
                                                    "kvstash")


@pytest.fixture
def model(request):
    """A model name of the test's own: its pool is not shared with other tests."""
    return "api-" + request.node.name.replace("[", "-").replace("]", "")


def stats_seq(st, seq_id):
    return next((q for q in st["sequences"] if q["seq_id"] == seq_id), None)


def random_kv(rng, geo, n):
    """K and V of n tokens with random bits: every byte pattern must survive."""
    shape = (geo.kv_heads, n, geo.head_dim)
    nbytes = geo.kv_heads * n * geo.head_dim * geo.numpy_dtype.itemsize
    k = np.frombuffer(rng.bytes(nbytes), dtype=geo.numpy_dtype).reshape(shape).copy()
    v = np.frombuffer(rng.bytes(nbytes), dtype=geo.numpy_dtype).reshape(shape).copy()
    return k, v


def test_attach_reports_the_pools_shape(daemon, model):
    with Session.attach(model, GEO, socket=daemon.sock, worker_name="api-shape") as s:
        assert s.attached and s.backend == "host"
        # The daemon fills in rope_theta 0 = 10000; the rest is what we asked for.
        assert s.geometry == Geometry(3, 4, 2, 8, 4, "fp32", 10000.0)
        assert s.block_bytes == 2 * 2 * 4 * 8 * 4
        assert s.block_count * s.block_bytes <= s.pool_bytes == s.pool_array().nbytes
        st = kvstash.stats(daemon.sock)
        (me,) = [x for x in st["sessions"] if x["session_id"] == s.id]
        assert me["worker_name"] == "api-shape" and me["pid"] == os.getpid()
        (pool,) = [p for p in st["pools"] if p["pool_id"] == s.pool_id]
        assert pool["model"] == model and pool["blocks_total"] == s.block_count
        assert pool["block_bytes"] == s.block_bytes
    assert not s.attached
    assert all(x["session_id"] != s.id for x in kvstash.stats(daemon.sock)["sessions"])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_append_write_read_round_trip_byte_for_byte(daemon, model, dtype):
    geo = Geometry(3, 4, 2, 8, 4, dtype)
    rng = np.random.default_rng(7)
    with Session.attach(model, geo, socket=daemon.sock) as s, s.create_sequence("full") as seq:
        written = []
        appended = 0
        for n in (7, 5):  # the first append spans two blocks; the second continues one
            t = seq.append(n)
            assert t.first_position == appended
            appended += n
            assert len(t.lists) == geo.layers and t.heads == 1
            kvs = [random_kv(rng, geo, n) for _ in range(geo.layers)]
            for lst, (k, v) in zip(t.lists, kvs):
                assert lst.tokens == n and lst.segments["count"].sum() == n
                seq.write(lst, k, v)
            written += kvs
        tab = seq.table(with_positions=True)
        for lst in tab.lists:
            assert lst.positions.tolist() == list(range(12))
            k, v = seq.read(lst)
            want_k = np.concatenate([written[lst.layer][0], written[geo.layers + lst.layer][0]], 1)
            want_v = np.concatenate([written[lst.layer][1], written[geo.layers + lst.layer][1]], 1)
            assert k.dtype == geo.numpy_dtype and k.shape == (2, 12, 8)
            assert k.tobytes() == want_k.tobytes() and v.tobytes() == want_v.tobytes()
            # The same bytes through the pool views, segment by segment.
            t0 = 0
            for block, first, count, tier in lst.segments.tolist():
                assert tier == kvstash.TIER_FULL
                got = s.block_keys(block)[:, first:first + count, :]
                assert got.tobytes() == want_k[:, t0:t0 + count, :].tobytes()
                got = s.block_values(block)[:, first:first + count, :]
                assert got.tobytes() == want_v[:, t0:t0 + count, :].tobytes()
                t0 += count


def test_write_checks_shape_and_dtype(daemon, model):
    with Session.attach(model, GEO, socket=daemon.sock) as s, s.create_sequence() as seq:
        lst = seq.append(3).lists[0]
        ok = np.zeros((2, 3, 8), np.float32)
        with pytest.raises(kvstash.InvalidArgument, match=r"shape \(2, 4, 8\).*needs \(2, 3, 8\)"):
            seq.write(lst, np.zeros((2, 4, 8), np.float32), ok)
        with pytest.raises(kvstash.InvalidArgument, match="float64; the pool holds float32"):
            seq.write(lst, ok, np.zeros((2, 3, 8)))
        with pytest.raises(kvstash.InvalidArgument, match="outside the pool"):
            s.block_keys(s.block_count)


def test_torch_tensors_are_views_of_the_pool(daemon, model):
    torch = pytest.importorskip("torch")
    with Session.attach(model, GEO, socket=daemon.sock) as s, s.create_sequence() as seq:
        lst = seq.append(2).lists[1]
        block, first = int(lst.segments["block"][0]), int(lst.segments["first_slot"][0])
        keys = torch.from_numpy(s.block_keys(block))
        keys[1, first:first + 2, :] = torch.arange(16, dtype=torch.float32).reshape(2, 8)
        k, _ = seq.read(lst)  # kvs_layer_read copies from the pool: it sees the tensor's write
        assert k[1].tolist() == np.arange(16, dtype=np.float32).reshape(2, 8).tolist()
        # ...and a tensor handed to write() is read without a copy on our side.
        seq.write(lst, torch.full((2, 2, 8), 2.5), torch.full((2, 2, 8), -1.0))
        assert float(keys[0, first, 0]) == 2.5


def test_step_statistics_reach_the_policy(daemon, model):
    """h2o keeps the `recent` newest tokens plus the highest accumulated
    scores: which positions survive shows that each layer's array arrived."""
    with Session.attach(model, GEO, socket=daemon.sock) as s, \
            s.create_sequence("h2o", {"budget": 6, "recent": 2}) as seq:
        t = seq.append(12)
        assert seq.epoch() == t.epoch
        rng = np.random.default_rng(3)
        score = [rng.permutation(12).astype(np.float32) for _ in range(GEO.layers)]
        r = seq.step(new_tokens=12, prefill=True, score=score, score_queries=1)
        assert isinstance(r, kvstash.StepResult)
        assert r.evicted == GEO.layers * 6 and r.epoch > t.epoch
        assert seq.epoch() == r.epoch
        tab = seq.table()
        assert tab.epoch == r.epoch
        for lst in tab.lists:
            old = np.argsort(-score[lst.layer][:10], kind="stable")[:4]
            assert sorted(lst.positions.tolist()) == sorted(old.tolist() + [10, 11])


def test_step_cuts_name_what_it_removed(daemon, model):
    """A step that only evicts answers with its cuts: the indices each list
    lost, so that the table before it, without them, is the table after."""
    rng = np.random.default_rng(5)
    with Session.attach(model, GEO, socket=daemon.sock) as s, \
            s.create_sequence("h2o", {"budget": 10, "recent": 2}) as seq:
        seq.append(16)
        before = seq.table()
        cut_steps = 0
        for step in range(24):
            n = before.lists[0].tokens
            score = [rng.random(n).astype(np.float32) for _ in range(GEO.layers)]
            r = seq.step(new_tokens=16 if step == 0 else 1, prefill=step == 0, score=score,
                         score_queries=1)
            after = seq.table()
            assert after.epoch == r.epoch and r.evicted == GEO.layers * (n - 10)
            if r.cuts is not None:  # else a compaction moved tokens: read the table
                cut_steps += 1
                assert r.cut_epoch == before.epoch
                assert sum(c.shape[0] for c in r.cuts) == r.evicted
                for old, new, cut in zip(before.lists, after.lists, r.cuts):
                    assert np.delete(old.positions, cut).tolist() == new.positions.tolist()
            seq.append(1)
            before = seq.table()
        assert cut_steps >= 12


def test_step_per_head_statistics(daemon, model):
    """weightedkv keeps one list per KV head and reads last_attn: q heads 0, 1
    read KV head 0's list, 2, 3 KV head 1's; tokens come from the rows."""
    with Session.attach(model, GEO, socket=daemon.sock) as s, \
            s.create_sequence("weightedkv", {"cache_size": 6, "n_init": 1,
                                             "n_recent": 2}) as seq:
        t = seq.append(9)
        assert t.heads == GEO.kv_heads and len(t.lists) == GEO.layers * GEO.kv_heads
        assert all(lst.per_head and lst.head == i % 2 for i, lst in enumerate(t.lists))
        attn = [np.full(9, 1 / 9, np.float32) for _ in range(GEO.layers * GEO.q_heads)]
        r = seq.step(new_tokens=9, last_attn=attn)
        assert r.evicted > 0
        tab = seq.table()
        assert [lst.tokens for lst in tab.lists] == [6] * (GEO.layers * GEO.kv_heads)
        k, v = seq.read(tab.list(2, 1))  # per-head lists read as [tokens][head_dim]
        assert k.shape == (6, GEO.head_dim)


def test_step_rows_written_in_the_ring(daemon, model):
    """Statistics written into the ring's rows (step_rows) decide as the
    same values passed as arrays: two sequences of two sessions, stepped
    each way, keep the same positions; the rows are views that step() does
    not copy (kvs_seq_step's copy onto itself is skipped, so a row that is
    not where the ring wants it would still be correct: the layout is
    checked by the pointers)."""
    rng = np.random.default_rng(9)
    with Session.attach(model, GEO, socket=daemon.sock) as a, \
            Session.attach(model, GEO, socket=daemon.sock) as b, \
            a.create_sequence("h2o", {"budget": 20, "recent": 4}) as qa, \
            b.create_sequence("h2o", {"budget": 20, "recent": 4}) as qb:
        for step in range(30):
            count = 24 if step == 0 else 1
            qa.append(count), qb.append(count)
            tokens = [lst.tokens for lst in qa.table(with_positions=False).lists]
            score = [rng.random(n).astype(np.float32) for n in tokens]
            rows = qb.step_rows(tokens, score=True)
            assert rows.last_attn is None and len(rows.score) == GEO.layers
            base = rows.score[0].ctypes.data
            assert [r.ctypes.data - base for r in rows.score] == \
                [4 * sum(tokens[:layer]) for layer in range(GEO.layers)]
            for row, values in zip(rows.score, score):
                row[:] = values
            ra = qa.step(new_tokens=count, prefill=step == 0, score=score, score_queries=1)
            rb = qb.step(new_tokens=count, prefill=step == 0, tokens=tokens, score=rows.score,
                         score_queries=1)
            assert ra.evicted == rb.evicted > 0
            assert [lst.positions.tolist() for lst in qa.table().lists] == \
                [lst.positions.tolist() for lst in qb.table().lists]
        with pytest.raises(kvstash.InvalidArgument, match="--ring-mb"):
            qb.step_rows([1 << 22] * GEO.layers, score=True)
        with pytest.raises(kvstash.InvalidArgument, match="at least one"):
            qb.step_rows(tokens)


def test_step_shapes_are_checked_before_sending(daemon, model, monkeypatch):
    with Session.attach(model, GEO, socket=daemon.sock) as s, \
            s.create_sequence("h2o", {"budget": 64}) as seq:
        seq.append(5)
        epoch = seq.epoch()

        def no_call(*args):
            raise AssertionError("kvs_seq_step was called with arrays the binding should refuse")

        monkeypatch.setattr(s._lib, "kvs_seq_step", no_call)
        good = [np.ones(5, np.float32)] * GEO.layers
        cases = [
            (dict(score=good[:2]), r"score has 2 arrays; the geometry needs 3"),
            (dict(tokens=[5, 5, 5], score=good[:2] + [np.ones(4, np.float32)]),
             r"score\[2\] \(layer 2, row 0\) has 4 values; tokens says list 2 holds 5"),
            (dict(score=good, last_attn=[np.ones(5)] * (3 * 4 - 1)),
             r"last_attn has 11 arrays; the geometry needs 12"),
            (dict(score=good, last_attn=[np.ones(5)] * 11 + [np.ones(6)]),
             r"last_attn\[11\] \(layer 2, row 3\) has 6 values"),
            (dict(score=[np.ones((5, 1), np.float32)] * 3), r"score\[0\] has shape \(5, 1\)"),
            (dict(tokens=[5, 5], score=good), r"tokens has shape \(2,\); expected 3 counts"),
        ]
        for kwargs, message in cases:
            with pytest.raises(kvstash.InvalidArgument, match=message):
                seq.step(new_tokens=5, **kwargs)
        monkeypatch.undo()
        assert seq.epoch() == epoch
        # Consistent with itself but not with the table: the daemon refuses,
        # with its own message.
        with pytest.raises(kvstash.InvalidArgument) as e:
            seq.step(new_tokens=5, score=[np.ones(4, np.float32)] * GEO.layers)
        assert e.value.code == -1 and "Step" in str(e.value)
        seq.step(new_tokens=5, score=good)


def test_revive_and_tiers(daemon, model):
    """An operator offloads positions 0-3 into the sketch and demotes 4-7 to
    INT8: reading the list refuses (sketch), revive rebuilds all of it."""
    rng = np.random.default_rng(11)
    with Session.attach(model, GEO, socket=daemon.sock) as s, \
            s.create_sequence("full", {"sketch_buckets": 4096}) as seq:
        t = seq.append(12)
        shape = (GEO.kv_heads, 12, GEO.head_dim)
        kv = [(rng.standard_normal(shape).astype(np.float32),
               rng.standard_normal(shape).astype(np.float32)) for _ in range(GEO.layers)]
        for lst, (k, v) in zip(t.lists, kv):
            seq.write(lst, k, v)
        seq.step(new_tokens=12)
        for verb, span in (("offload", "0-3"), ("demote", "4-7")):
            out = subprocess.run([CLI, "--socket", daemon.sock, verb, str(seq.id), span],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
        lst = seq.table().list(1)
        assert lst.tiers.tolist() == [kvstash.TIER_SKETCH, kvstash.TIER_INT8, kvstash.TIER_FULL]
        assert lst.segments["block"][0] == kvstash.NO_BLOCK
        with pytest.raises(kvstash.FailedPrecondition, match="4 tokens are held only in the "
                                                             "sketch"):
            seq.read(lst)
        with seq.revive(layer=1) as rv:
            assert (rv.from_sketch, rv.from_int8, rv.from_full) == (4, 4, 4)
            assert rv.source_tier.tolist() == [2] * 4 + [1] * 4 + [0] * 4
            assert rv.list.positions.tolist() == list(range(12))
            k, v = rv.read()
            want_k, want_v = kv[1]
            assert np.array_equal(k[:, 8:], want_k[:, 8:]) and np.array_equal(v[:, 8:],
                                                                               want_v[:, 8:])
            # INT8: within max|x| / 254 per channel group; the sketch (no
            # collisions at 4096 buckets) gives the tokens back.
            bound = np.abs(want_k[:, 4:8]).max() / 254 + 1e-6
            assert np.abs(k[:, 4:8] - want_k[:, 4:8]).max() <= bound
            assert np.allclose(k[:, :4], want_k[:, :4], atol=1e-5)
            scratch = rv.scratch_id
        assert rv.released and scratch > 0
        # In place: the 4 full-precision tokens are the list's own slots,
        # the 8 others rebuilt as above; the same values.
        with seq.revive(layer=1) as rv, seq.revive(layer=1, in_place=True) as here:
            assert here.scratch_id > 0 and here.epoch == rv.epoch == seq.table().epoch
            held = lst.segments[2]
            seg = here.list.segments[-1]
            assert (seg["block"], seg["first_slot"], seg["count"]) == \
                (held["block"], held["first_slot"], 4)
            assert rv.list.segments[-1]["block"] != held["block"]
            for a, b in zip(rv.read(), here.read()):
                assert np.array_equal(a, b)
        with seq.revive(layer=1, first=8, in_place=True) as here:
            assert here.scratch_id == 0 and here.from_full == 4
            assert np.array_equal(here.read()[0], want_k[:, 8:])


def test_release_detach_and_stats(daemon, model):
    s = Session.attach(model, GEO, socket=daemon.sock)
    seq = s.create_sequence("streaming", {"n_sink": 1, "window": 8}, label="lbl")
    seq.append(5)
    q = stats_seq(kvstash.stats(daemon.sock), seq.id)
    assert q["session_id"] == s.id and q["policy"] == "streaming" and q["label"] == "lbl"
    assert q["tokens"] == 5 * GEO.layers and q["blocks"] == 2 * GEO.layers
    seq.release()
    assert seq.released and stats_seq(kvstash.stats(daemon.sock), seq.id) is None
    with pytest.raises(kvstash.NotFound):
        seq.append(1)
    other = s.create_sequence()
    s.detach()
    s.detach()  # idempotent
    with pytest.raises(kvstash.InvalidArgument, match="detached"):
        other.append(1)
    st = kvstash.stats(daemon.sock)
    assert stats_seq(st, other.id) is None
    assert all(x["session_id"] != s.id for x in st["sessions"])


def test_context_managers_release_on_exception(daemon, model):
    with Session.attach(model, GEO, socket=daemon.sock) as s:
        with pytest.raises(ZeroDivisionError):
            with s.create_sequence() as seq:
                seq.append(4)
                1 / 0
        assert seq.released and stats_seq(kvstash.stats(daemon.sock), seq.id) is None
        kept = s.create_sequence()
        kept.append(4)
    with pytest.raises(KeyError):
        with Session.attach(model, GEO, socket=daemon.sock) as s2:
            s2.create_sequence().append(1)
            raise KeyError("boom")
    st = kvstash.stats(daemon.sock)
    assert stats_seq(st, kept.id) is None  # detach released it
    assert all(x["session_id"] not in (s.id, s2.id) for x in st["sessions"])
    assert not any(q["session_id"] == s2.id for q in st["sequences"])


FORK_SCRIPT = """
import os, sys
import kvstash
s = kvstash.Session.attach(sys.argv[1], kvstash.Geometry(3, 4, 2, 8, 4), socket=sys.argv[2])
seq = s.create_sequence()
seq.append(2)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit runs the child's copy of the finalizers
_, status = os.waitpid(pid, 0)
print(status, seq.append(1).first_position, flush=True)
s.detach()
"""


def test_a_forked_childs_exit_leaves_the_parents_session(daemon, model):
    """A child forked with a session (multiprocessing does it) must not
    detach the parent's session when it exits."""
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT, model, daemon.sock],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "2"], out.stdout
