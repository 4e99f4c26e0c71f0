"""`streaming` through the real daemon (issue 2, acceptance 3): the policy
decides after each step (on the gRPC path, a step ends when the next Append
begins), so right after appending token t-1 the sequence holds exactly the
sink tokens, the window of the tokens before, and the new token. The blocks it
frees are reused: a long sequence runs in a pool far smaller than its total
length."""
import sys

from kvstash_harness import Worker, call, geometry, pb, run_tests

N_SINK, WINDOW, BLOCK = 4, 16, 4
TOKENS = 3000
# --pool-mb 1 with head_dim 64, block_tokens 4: 256 blocks of 4 KiB. Without
# reuse, 3000 tokens x 2 layers would need 1500 blocks.
GEOM = geometry(head_dim=64, block_tokens=BLOCK)


def expected_positions(t):
    """Held after the append that brought the sequence to t tokens."""
    return list(range(min(N_SINK, t))) + list(range(max(N_SINK, t - 1 - WINDOW), t))


def check_exact_sinks_and_window(ctx):
    d = ctx.daemon
    w = Worker(d)
    ctx.workers = [w]
    att = w.attach("stream", GEOM)
    assert att.block_count < TOKENS * 2 // BLOCK, att
    seq = call(d.store.CreateSequence,
               pb.CreateSequenceRequest(policy="streaming",
                                        params=[pb.Param(key="n_sink", value=str(N_SINK)),
                                                pb.Param(key="window", value=str(WINDOW))]),
               w.md, "CreateSequence").seq_id
    epoch = 0
    prev_blocks = set()
    left_table = set()
    for t in range(1, TOKENS + 1):
        a = call(d.store.Append, pb.AppendRequest(seq_id=seq, count=1, ack_epoch=epoch), w.md)
        assert a.epoch == epoch + 1, f"epoch {a.epoch} after {epoch}"
        epoch = a.epoch
        assert a.first_position == t - 1
        if t % 7 == 0 or t < 40 or t == TOKENS:
            tb = call(d.store.GetBlockTable,
                      pb.GetBlockTableRequest(seq_id=seq, with_positions=True, ack_epoch=epoch),
                      w.md)
            assert tb.epoch == epoch
            for layer in tb.layers:
                assert list(layer.positions) == expected_positions(t), \
                    f"t={t} layer {layer.layer}: {list(layer.positions)}"
                assert sum(layer.count) == layer.tokens == len(layer.positions)
            blocks = {b for layer in tb.layers for b in layer.block}
            left_table |= prev_blocks - blocks
            prev_blocks = blocks
    # The pool could not have held 3000 tokens: blocks were freed and reused.
    assert left_table, "no block ever left the table"
    st = d.stats()
    (pool,) = [p for p in st.pools if p.model == "stream"]
    (sq,) = [q for q in st.sequences if q.seq_id == seq]
    assert sq.appended == TOKENS
    assert sq.tokens == 2 * (N_SINK + WINDOW + 1), sq
    assert pool.blocks_total - pool.blocks_free == sq.blocks, (pool, sq)
    ctx.seq, ctx.worker, ctx.left_table = seq, w, left_table


def check_freed_blocks_go_to_new_sequences(ctx):
    d, w = ctx.daemon, ctx.worker
    other = call(d.store.CreateSequence, pb.CreateSequenceRequest(policy="full"), w.md).seq_id
    a = call(d.store.Append, pb.AppendRequest(seq_id=other, count=200), w.md)
    used = {b for layer in a.writes for b in layer.block}
    assert used & ctx.left_table, "a new sequence got none of the blocks streaming freed"
    r = call(d.store.ReleaseSequence, pb.ReleaseSequenceRequest(seq_id=other), w.md)
    assert r.blocks_freed == len(used), (r, len(used))


if __name__ == "__main__":
    sys.exit(run_tests("streaming", [check_exact_sinks_and_window,
                                     check_freed_blocks_go_to_new_sequences],
                       daemon_kwargs={"pool_mb": 1}))
