"""The step statistics as the binding lays them out for kvs_step (no
daemon): row pointers, token counts read off the arrays, and what it
refuses before any call."""
import numpy as np
import pytest

import kvstash
from kvstash import stepstats

LAYERS, Q, KV = 2, 4, 2


def build(heads=1, tokens=None, score=None, last_attn=None, window_attn=None, vnorm=None):
    return stepstats.build(LAYERS, Q, KV, heads, 3, False, tokens,
                           (score, last_attn, window_attn, vnorm), 1, 0, 0.25)


def test_rows_point_at_the_arrays_and_counts_come_from_them():
    score = [np.arange(5, dtype=np.float32), np.arange(7, dtype=np.float64)]  # f64: converted
    args = build(score=score)
    st = args.c
    assert (st.new_tokens, st.prefill, st.heads, st.score_queries) == (3, 0, 1, 1)
    assert st.confidence == 0.25 and not st.last_attn and not st.vnorm
    assert [st.tokens[i] for i in range(LAYERS)] == [5, 7]
    assert [st.score[1][i] for i in range(7)] == list(range(7))
    assert [st.score[0][i] for i in range(5)] == list(range(5))


def test_per_head_rows_read_their_kv_heads_list():
    # q heads 0, 1 read KV head 0's list (4 tokens), q heads 2, 3 KV head 1's (6).
    attn = [np.full(4 if h % Q < 2 else 6, h, np.float32) for h in range(LAYERS * Q)]
    st = build(heads=KV, last_attn=attn).c
    assert [st.tokens[i] for i in range(LAYERS * KV)] == [4, 6, 4, 6]
    assert st.last_attn[6][5] == 6.0
    vnorm = [np.ones(4 if g % 2 == 0 else 6, np.float32) for g in range(LAYERS * KV)]
    st = build(heads=KV, last_attn=attn, vnorm=vnorm).c
    assert st.vnorm and [st.tokens[i] for i in range(4)] == [4, 6, 4, 6]


def test_refusals():
    with pytest.raises(kvstash.InvalidArgument, match=r"do not say how many tokens lists \[1, 3\]"):
        build(heads=KV, score=[np.ones(4, np.float32)] * LAYERS)
    attn = [np.ones(4, np.float32)] * (LAYERS * Q)
    attn[3] = np.ones(5, np.float32)  # q head 3 reads list 1 too, like q head 2
    with pytest.raises(kvstash.InvalidArgument, match=r"last_attn\[3\] \(layer 0, row 3\) has 5 "
                                                      r"values; the list's other arrays say"):
        build(heads=KV, last_attn=attn)
    with pytest.raises(kvstash.InvalidArgument, match="tokens must be uint32 counts"):
        build(tokens=[-1, 2])
    with pytest.raises(kvstash.InvalidArgument, match="new_tokens=-3 is not a uint32"):
        stepstats.build(LAYERS, Q, KV, 1, -3, False, None, (None,) * 4, 0, 0, None)
