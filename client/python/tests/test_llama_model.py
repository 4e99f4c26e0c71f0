"""The PyTorch worker's pieces without a daemon: checkpoint checks, the
tokenizer, the batched forward pass (one pass per step for all lanes, each
lane's result what it gets alone), the INT8 block geometry, the --budget
mapping and confkv's confidence.
"""
import math
import os

import numpy as np
import pytest
import torch

from kvstash.llama import policies
from kvstash.llama.checkpoint import Checkpoint, CheckpointError
from kvstash.llama.model import Llama, logprob
from kvstash.llama.pool import int8_block_bytes, int8_tokens_per_block
from kvstash.llama.runner import Runner, make_caches
from kvstash.llama.tokenizer import TOK_BOS, Tokenizer
from llama_helpers import MODEL, TOKENIZER, need_model


@pytest.fixture(scope="module")
def model():
    need_model()
    return Llama(Checkpoint(MODEL))


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer(TOKENIZER, model.c.vocab_size)


def test_checkpoint_header_and_size_are_checked(tmp_path, model):
    c = model.c
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len) == \
        (64, 5, 8, 4, 512, 512)
    with open(MODEL, "rb") as f:
        head = f.read(4096)
    short = os.path.join(str(tmp_path), "short.bin")
    with open(short, "wb") as f:
        f.write(head)
    with pytest.raises(CheckpointError, match="bytes, but its header describes"):
        Checkpoint(short)
    bad = os.path.join(str(tmp_path), "bad.bin")
    with open(bad, "wb") as f:
        f.write(np.array([64, 172, 5, 7, 4, 512, 512], dtype="<i4").tobytes())
    with pytest.raises(CheckpointError, match="n_heads 7"):
        Checkpoint(bad)


def test_tokenizer_merges_and_byte_fallback(tok):
    ids = tok.encode(b"Once upon a time")
    assert ids[0] == TOK_BOS and len(ids) < len(" Once upon a time")  # pieces were merged
    text = b"".join(tok.decode(prev, cur) for prev, cur in zip(ids, ids[1:]))
    assert text == b"Once upon a time"  # BOS drops the dummy prefix's space
    # A code point without a piece becomes its UTF-8 bytes as byte tokens (id = byte + 3).
    snow = "\u2603".encode()
    assert snow not in tok.ids
    ids = tok.encode(snow, bos=False)
    assert ids[1:] == [b + 3 for b in snow] and tok.decode(0, ids[1]) == snow[:1]
    assert tok.encode(b"", bos=True) == [TOK_BOS]


def test_batched_forward_equals_lanes_alone(model, tok):
    """Three sequences side by side, one forward pass per step, give each
    lane the logits it gets alone."""
    texts = [b"Once upon a time there was a cat.", b"The dog ran to the park.",
             b"Lily liked to play with her red ball every day."]
    ids = [tok.encode(t) for t in texts]
    steps = min(len(i) for i in ids)
    calls = []

    def run(lanes_ids):
        r = Runner(model, make_caches(model, len(lanes_ids)))
        forward = r.forward
        r.forward = lambda lanes, tokens: calls.append(len(lanes)) or forward(lanes, tokens)
        out = []
        with torch.no_grad():
            for ln in r.lanes:
                ln.cache.seq_begin("t")
            for pos in range(steps):
                for ln in r.lanes:
                    ln.pos = pos
                out.append(r.forward(r.lanes, [i[pos] for i in lanes_ids]))
        return np.stack(out)  # [steps, lanes, vocab]

    together = run(ids)
    assert calls == [3] * steps  # one pass per step for all three
    for b, one in enumerate(ids):
        alone = run([one])[:, 0]
        assert np.abs(alone - together[:, b]).max() <= 1e-5
    # The lanes did see different stories.
    assert np.abs(together[-1, 0] - together[-1, 1]).max() > 0.1
    lp = logprob(together[0, 0], ids[0][1])
    assert -20 < lp < 0 and math.isfinite(lp)


def test_int8_block_geometry_matches_kernels_h():
    # kernels.h: "fp16, 8 heads x 128 channels, 16 tokens: 28; fp32: 60".
    assert int8_tokens_per_block(8, 16, 128, 2) == 28
    assert int8_tokens_per_block(8, 16, 128, 4) == 60
    assert int8_block_bytes(8, 28, 128) <= 2 * 8 * 16 * 128 * 2 < int8_block_bytes(8, 29, 128)
    # stories260K's fp32 pool with 4-token blocks: all heads 12, one head's rows 60.
    assert int8_tokens_per_block(4, 4, 8, 4) == 12
    assert int8_tokens_per_block(1, 16, 8, 4) == 60


def test_budget_mapping_is_kvstash_llamas():
    assert policies.budget_params("snapkv", 32, 4) == [("budget", "32"), ("window", "8")]
    assert policies.budget_params("snapkv", 256, 4) == [("budget", "256"), ("window", "32")]
    assert policies.budget_params("ov_block", 32, 4) == [
        ("start_size", "4"), ("recent_size", "8"), ("max_cache_size", "32")]
    with pytest.raises(policies.PolicyError, match="too small for ov_block"):
        policies.budget_params("ov_block", 32, 16)
    assert policies.budget_params("confkv", 32, 4) == [
        ("budget_tight", "32"), ("budget_loose", "64"), ("protect", "8"), ("fp16_window", "16")]
    p = policies.resolve("criticalkv", [("window", "5")], 32, "int8", 4, 512)
    assert p.params == [("window", "5"), ("budget", "32"), ("demote", "int8"),
                        ("int8_window", "8")]
    assert p.window == 5 and p.per_head and p.needs & policies.NEEDS_VNORM
    assert policies.resolve("snapkv", [], 0, "off", 4, 40).window == 40  # capped at the context
    with pytest.raises(policies.PolicyError, match="keeps every token"):
        policies.resolve("full", [], 32, "off", 4, 512)


def test_confidence_of_logits():
    w = policies.ConfidenceWeights()
    rng = np.random.default_rng(7)
    z = rng.normal(size=300).astype(np.float32) * 3
    p = np.exp(z.astype(np.float64) - z.max())
    p /= p.sum()
    top = np.sort(p)[::-1]
    h = -(p * np.log(p)).sum() / math.log(len(p))
    want = 0.4 * (1 - h) + 0.3 / (1 + top[1] / top[0]) + 0.3 * top[0]  # sigma(ln p1 - ln p2)
    assert policies.confidence(z, w) == pytest.approx(want, abs=1e-12)
    peaked = np.zeros(300, dtype=np.float32)
    peaked[3] = 80.0
    assert policies.confidence(peaked, w) > 0.99
    z[5] = np.inf
    assert policies.confidence(z, w) == -1.0
