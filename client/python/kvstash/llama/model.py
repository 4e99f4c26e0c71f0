"""model.py - the Llama-2 forward pass of kvstash-llama, in PyTorch (fp32).

The arithmetic is client/llama/model.c's (after llama2.c's run.c): RMSNorm
with eps 1e-5, RoPE with interleaved pairs (i, i+1) and base 10000, grouped
query attention, SwiGLU. As in model.c, attention itself is split off: a
layer is layer_qkv (q, k, v of every token of the batch), then the caller's
attention over its cache (attend(), given the cache's K and V), then
layer_finish. That split lets the same pass run over the in-process cache
and over kvstashd's pool.

Every step is batched: row b of each tensor is one token of one sequence
(lane), so a batch of B sequences reads each weight once per step.

The RoPE angles are computed the way model.c computes them in float
(freq = 1 / powf(10000, hd / head_size), angle = pos * freq), with the
cosine and sine of each float angle rounded from double; the two workers'
query and key rotations then agree to the last bit or one ulp.
"""
import math
from typing import Tuple

import numpy as np
import torch

from .checkpoint import Checkpoint, Config

RMS_EPS = 1e-5
ROPE_BASE = 10000.0


def rope_tables(c: Config) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle: [seq_len][head_size / 2]."""
    hs = np.float32(c.head_size)
    pair_dims = np.arange(0, c.head_size, 2, dtype=np.float32)  # hd = i % head_size
    exponent = (pair_dims / hs).astype(np.float32)
    power = np.power(np.float64(ROPE_BASE), exponent.astype(np.float64)).astype(np.float32)
    freq = (np.float32(1.0) / power).astype(np.float32)
    pos = np.arange(c.seq_len, dtype=np.float32)[:, None]
    angle = (pos * freq[None, :]).astype(np.float32)
    cos = np.cos(angle.astype(np.float64)).astype(np.float32)
    sin = np.sin(angle.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), per row, in fp32."""
    ss = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1] + RMS_EPS
    return weight * ((1.0 / torch.sqrt(ss)) * x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2j, 2j+1) of x [B, heads, head_size] by the
    per-row angles (cos, sin: [B, head_size / 2])."""
    B, H, D = x.shape
    pairs = x.reshape(B, H, D // 2, 2)
    v0, v1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((v0 * c - v1 * s, v0 * s + v1 * c), dim=-1).reshape(B, H, D)


class Llama:
    """A llama2.c model's forward pass over a batch of tokens."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.c = ckpt.config
        self.w = ckpt.weights
        self.cos, self.sin = rope_tables(self.c)
        self.scale = float(np.float32(1.0) / np.float32(math.sqrt(self.c.head_size)))
        self.group = self.c.n_heads // self.c.n_kv_heads
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> "Llama":
        """Move the weights and RoPE tables to `device` (e.g. the GPU of a
        cuda pool); the pass then runs there."""
        self.device = torch.device(device)
        self.w = {name: t.to(self.device) for name, t in self.w.items()}
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """x [B, dim]: the embeddings of tokens [B] (a copy; x is updated in place)."""
        return self.w["token_embedding"].index_select(0, tokens).clone()

    def layer_qkv(self, x: torch.Tensor, layer: int,
                  pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, n_heads, hs], k and v [B, n_kv_heads, hs] of layer `layer`,
        RoPE at positions pos [B] applied to q and k."""
        c, w = self.c, self.w
        B = x.shape[0]
        xb = rmsnorm(x, w["rms_att"][layer])
        q = torch.nn.functional.linear(xb, w["wq"][layer]).view(B, c.n_heads, c.head_size)
        k = torch.nn.functional.linear(xb, w["wk"][layer]).view(B, c.n_kv_heads, c.head_size)
        v = torch.nn.functional.linear(xb, w["wv"][layer]).view(B, c.n_kv_heads, c.head_size)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def layer_finish(self, x: torch.Tensor, att: torch.Tensor, layer: int) -> torch.Tensor:
        """x + W^O att, then the SwiGLU feed-forward block with its residual."""
        w = self.w
        x = x + torch.nn.functional.linear(att, w["wo"][layer])
        xb = rmsnorm(x, w["rms_ffn"][layer])
        h1 = torch.nn.functional.linear(xb, w["w1"][layer])
        h3 = torch.nn.functional.linear(xb, w["w3"][layer])
        hb = h1 * (1.0 / (1.0 + torch.exp(-h1))) * h3
        return x + torch.nn.functional.linear(hb, w["w2"][layer])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[B, vocab] = wcls rmsnorm(x)."""
        return torch.nn.functional.linear(rmsnorm(x, self.w["rms_final"]), self.w["wcls"])

    def wo(self, layer: int) -> torch.Tensor:
        """W^O of a layer ([dim][dim], o_proj.weight), for value norms."""
        return self.w["wo"][layer]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
           scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per lane over padded caches.

    q [B, n_heads, hs]; keys, values [B, n_kv_heads, N, hs] (fp32), the first
    lengths[b, g] tokens of row (b, g) real and the rest padding (which must
    be finite: callers zero it). Query head h reads KV head h // group.
    Returns the output [B, n_heads * hs] and the softmax probabilities
    [B, n_kv_heads, group, N] (0 on padding).
    """
    B, H, D = q.shape
    KV, N = keys.shape[1], keys.shape[2]
    G = H // KV
    scores = torch.matmul(q.view(B, KV, G, D), keys.transpose(-1, -2)) * scale
    pad = torch.arange(N, device=keys.device).view(1, 1, 1, N) >= lengths.view(B, KV, 1, 1)
    scores = scores.masked_fill(pad, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)
    return out.reshape(B, H * D), probs


def logprob(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token] in double, as model.c's llm_logprob."""
    z = logits.astype(np.float64)
    mx = z.max()
    return float(z[token] - mx - math.log(np.exp(z - mx).sum()))
