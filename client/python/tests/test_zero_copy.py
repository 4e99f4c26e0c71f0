"""Zero copy across processes (issue 13, acceptance 1): what this process
writes through its numpy and torch views of a block, another Python worker
(peer.py: its own process, session and mapping of the same pool) reads
through its views; what the peer writes, our views show without any call."""
import dataclasses

import numpy as np
import pytest

import kvstash
from kvstash import Geometry, Session
from procs import Peer, wait_until

GEO = Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=8, block_tokens=4, dtype="fp32")


def test_views_are_shared_between_processes(daemon):
    torch = pytest.importorskip("torch")
    with Session.attach("zc", GEO, socket=daemon.sock) as s, s.create_sequence() as seq:
        t = seq.append(6)
        lst0, lst1 = t.lists
        b0 = int(lst0.segments["block"][0])  # layer 0, slots 0-3
        b1 = int(lst1.segments["block"][0])  # layer 1, slots 0-3
        # numpy view: every K and V element of block b0's first 4 slots.
        pattern = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8) * 0.25 - 7
        s.block_keys(b0)[:, :4, :] = pattern
        s.block_values(b0)[:, :4, :] = -pattern
        # torch view: the K of block b1 through torch.from_numpy.
        keys1 = torch.from_numpy(s.block_keys(b1))
        keys1[:, :4, :] = torch.linspace(-1, 1, 64).reshape(2, 4, 8)

        peer = Peer(daemon.sock, "zc", dataclasses.asdict(GEO))
        try:
            assert peer.hello["pool"] == s.pool_id and peer.hello["session"] != s.id
            got = peer.call(op="keys", block=b0)
            assert np.array_equal(np.array(got["keys"], np.float32)[:, :4], pattern)
            assert np.array_equal(np.array(got["values"], np.float32)[:, :4], -pattern)
            got = peer.call(op="keys", block=b1)
            assert np.array_equal(np.array(got["keys"], np.float32)[:, :4], keys1[:, :4].numpy())

            # The peer writes K row (head 1, slot 2) of b0 through its torch
            # view; our numpy view shows it with no call on our side.
            view = s.block_keys(b0)
            before = view[1, 2].copy()
            peer.call(op="fill", block=b0, head=1, slot=2, value=1234.5)
            assert wait_until(lambda: view[1, 2, 0] == 1234.5, timeout=5)
            assert view[1, 2].tolist() == [1234.5] * 8 and before.tolist() != view[1, 2].tolist()
            assert np.array_equal(view[0], pattern[0])  # nothing else moved
            # ...and so does libkvstash's own read of the list.
            k, v = seq.read(seq.table().list(0))
            assert k[1, 2].tolist() == [1234.5] * 8 and np.array_equal(v[:, :4], -pattern)
        finally:
            assert peer.close() == 0


def test_the_whole_pool_is_one_mapping(daemon):
    """pool_array and block views share memory: a write through one is in
    the other (and kvs_key_ptr's addresses are the views' addresses)."""
    with Session.attach("zc-pool", GEO, socket=daemon.sock) as s:
        pool = s.pool_array()
        b = s.block_count - 1
        s.block_values(b)[1, 3, 7] = 42.0
        off = b * s.block_bytes + s.block_bytes // 2 + ((1 * 4 + 3) * 8 + 7) * 4
        assert pool[off:off + 4].view(np.float32)[0] == 42.0
        lib = kvstash._lib.lib()
        addr = lib.kvs_value_ptr(s.handle(), b, 1, 3)
        assert addr == s.block_values(b)[1, 3].ctypes.data
        assert lib.kvs_key_ptr(s.handle(), b, 0, 0) == s.block_keys(b).ctypes.data
