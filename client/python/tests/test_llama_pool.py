"""The PyTorch worker's cache against the real kvstashd, in process: what
the worker gathers from the pool's views by the block table (full-precision
blocks of every dtype, INT8, INT4 and INT2 blocks dequantised in torch) is exactly what
libkvstash's kvs_layer_read copies out of the same lists (Sequence.read),
for one-list and per-head policies; the worker's copy of each table follows
the daemon's; and sketched tokens are revived for attention (reviver),
scoring what the C worker scores.
"""
import numpy as np
import pytest
import torch

import kvstash
from kvstash.llama import policies
from kvstash.llama.checkpoint import Checkpoint
from kvstash.llama.model import Llama
from kvstash.llama.pool import TIER_INT2, TIER_INT4, TIER_INT8, LayerGather, PoolView
from kvstash.llama.runner import Runner, make_caches
from kvstash.llama.tokenizer import Tokenizer
from llama_helpers import (MODEL, TEXT, TOKENIZER, need_c_llama, need_model, score)

BLOCK_TOKENS = 4
TORCH_OF = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def model():
    need_model()
    return Llama(Checkpoint(MODEL))


def stories(n: int) -> list:
    with open(TEXT, "rb") as f:
        parts = [p.strip() for p in f.read().split(b"<|endoftext|>")]
    return [p for p in parts if p][:n]


def run_lanes(model: Llama, session, dtype: str, policy: policies.Policy, steps: int):
    """Two lanes, each a story of its own, `steps` tokens as batched
    forward passes (each token a decode step). Returns runner and view."""
    c = model.c
    view = PoolView(session.pool_array(), session.block_bytes, c.n_kv_heads, BLOCK_TOKENS,
                    c.head_size, dtype)
    run = Runner(model, make_caches(model, 2, session, view, policy), view, policy)
    tok = Tokenizer(TOKENIZER, c.vocab_size)
    for i, (ln, text) in enumerate(zip(run.lanes, stories(2))):
        ln.ids = tok.encode(text)
        assert len(ln.ids) > steps
        ln.cache.seq_begin(f"gather test {i}")
    with torch.no_grad():
        for pos in range(steps):
            for ln in run.lanes:
                ln.pos = pos
            logits = run.forward(run.lanes, [ln.ids[pos] for ln in run.lanes])
            for b, ln in enumerate(run.lanes):
                run.end_token(ln, logits[b], False, False)
    # The last step may have left a demotion that is published after its
    # answer: the tables compared below are the daemon's now.
    for ln in run.lanes:
        ln.cache.catch_up()
    return run, view


def as_pool_dtype(x: torch.Tensor, dtype: str) -> np.ndarray:
    """fp32 values rounded to the pool's dtype, as numpy sees the pool (bf16: bits)."""
    t = x.to(TORCH_OF[dtype])
    return t.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else t.numpy()


# (policy, budget, tokens): the daemon demotes whole INT8 blocks of the
# tokens past the newest 8 of a list, and a per-head list's INT8 block holds
# 60 rows of stories260K's fp32 pool: per-head lists need a larger budget.
CASES = [("h2o", 32, 60), ("snapkv", 96, 130)]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("policy_name,budget,steps", CASES)
def test_gather_by_table_equals_layer_read(daemon, model, dtype, policy_name, budget, steps):
    check_gather(daemon, model, dtype, policy_name, budget, steps, "int8")


# demote=int4 / int2 (issue 15): INT4 blocks of stories260K's 4-token pool
# blocks hold 18 (fp32) or 7 (fp16) tokens, INT2 ones 27 or 11; a per-head
# list's (16 rows of one head) 70 / 110 rows at fp32. Each budget leaves a
# block's worth past the newest 8 of a list.
LOWBIT_CASES = [("h2o", 48, 80, "int4"), ("h2o", 48, 80, "int2"), ("snapkv", 96, 130, "int4"),
                ("snapkv", 136, 170, "int2")]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("policy_name,budget,steps,demote", LOWBIT_CASES)
def test_gather_lowbit_equals_layer_read(daemon, model, dtype, policy_name, budget, steps, demote):
    check_gather(daemon, model, dtype, policy_name, budget, steps, demote)


def test_gather_lowbit_at_another_quant_group(make_daemon, model):
    """kvstashd --quant-group 8: the tables say so, and the torch gather reads
    the INT2 blocks with groups of 8 (per-head lists too), still equal to
    kvs_layer_read."""
    d = make_daemon(extra_args=["--quant-group", "8"])
    check_gather(d, model, "fp32", "h2o", 48, 80, "int2", group=8)
    check_gather(d, model, "fp16", "snapkv", 96, 130, "int2", group=8)


def check_gather(daemon, model, dtype, policy_name, budget, steps, demote, group=32):
    """Two lanes run; every list of every layer gathered by the block table
    equals kvs_layer_read's copy, bit for bit in the pool's dtype, and some
    tokens were in the `demote` tier."""
    c = model.c
    geo = kvstash.Geometry(layers=c.n_layers, q_heads=c.n_heads, kv_heads=c.n_kv_heads,
                           head_dim=c.head_size, block_tokens=BLOCK_TOKENS, dtype=dtype,
                           rope_theta=10000.0)
    policy = policies.resolve(policy_name, [], budget, demote, BLOCK_TOKENS, c.seq_len)
    tier = {"int8": TIER_INT8, "int4": TIER_INT4, "int2": TIER_INT2}[demote]
    with kvstash.Session.attach(model=f"gather-{dtype}", geometry=geo, socket=daemon.sock,
                                worker_name="test-llama-pool") as s:
        run, view = run_lanes(model, s, dtype, policy, steps)
        caches = [ln.cache for ln in run.lanes]
        int8_tokens = 0
        for layer in range(c.n_layers):
            g = LayerGather(view, len(caches))
            for b, cache in enumerate(caches):
                g.add(b, cache.layer_lists(layer), policy.per_head)
            keys, values, lengths = g.tensors()
            for b, cache in enumerate(caches):
                table = cache.seq.table(with_positions=True)
                assert table.epoch == cache.epoch
                heads = table.heads
                assert heads == (c.n_kv_heads if policy.per_head else 1)
                for h in range(heads):
                    lst = table.lists[layer * heads + h]
                    mine = cache.lists[layer * heads + h]
                    assert lst.quant_group == group and view.quant_group == group
                    assert np.array_equal(mine.pos, lst.positions)
                    int8_tokens += int(lst.segments["count"][lst.segments["tier"] == tier].sum())
                    k_read, v_read = cache.seq.read(lst)
                    n = lst.tokens
                    kv = [h] if policy.per_head else range(c.n_kv_heads)
                    for g_ in kv:
                        assert int(lengths[b, g_]) == n
                        want_k = k_read if policy.per_head else k_read[g_]
                        want_v = v_read if policy.per_head else v_read[g_]
                        assert np.array_equal(as_pool_dtype(keys[b, g_, :n], dtype), want_k)
                        assert np.array_equal(as_pool_dtype(values[b, g_, :n], dtype), want_v)
        # The budget evicted and older tokens were in the demote tier.
        assert all(cache.usage_.evicted > 0 for cache in caches)
        assert int8_tokens > 0, f"no {demote} segment: the dequantisation was not exercised"
        # Demotions published after a step's answer reached the caches as the
        # runs they moved, with the next append, not by a table read.
        assert sum(cache.moved for cache in caches) > 0
        run.close()


def test_revived_sketch_tokens_score_like_c_worker(daemon, tmp_path, model):
    """reviver keeps evicted tokens in a sketch; the worker revives them for
    attention, and its perplexity is the C worker's."""
    need_c_llama()
    args = ("--socket", daemon.sock, "--policy", "reviver", "--budget", "32")
    _, c = score("c", str(tmp_path), "reviver", 1, *args)
    _, t = score("torch", str(tmp_path), "reviver", 1, *args)
    assert t["tokens"] == c["tokens"] > 100
    assert abs(t["ppl"] - c["ppl"]) / c["ppl"] <= 1e-3, (t["ppl"], c["ppl"])
    geo = kvstash.Geometry(layers=model.c.n_layers, q_heads=model.c.n_heads,
                           kv_heads=model.c.n_kv_heads, head_dim=model.c.head_size,
                           block_tokens=BLOCK_TOKENS, dtype="fp32", rope_theta=10000.0)
    policy = policies.resolve("reviver", [], 32, "off", BLOCK_TOKENS, model.c.seq_len)
    with kvstash.Session.attach(model="revive", geometry=geo, socket=daemon.sock) as s:
        run, _ = run_lanes(model, s, "fp32", policy, 60)
        assert sum(ln.cache.revived_lists for ln in run.lanes) > 0, "no sketch token revived"
        run.close()
