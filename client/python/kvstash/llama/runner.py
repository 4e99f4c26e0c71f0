"""runner.py - lanes and the batched forward pass over their caches.

A lane is one sequence being processed: its cache (PlainCache or
KvstashCache), its token ids and position. forward() runs one token of
every given lane as one batch: each weight is read once per step for all of
them, and the attention of every lane is one padded, masked computation
over the K/V gathered from each lane's own list(s) (main.c forward(), with
cache.c's per-lane attention batched).
"""
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch

from . import policies
from .cache import KvstashCache, PlainCache, Step, gather_plain, vnorm_l1
from .model import Llama, attend
from .pool import LayerGather, PoolView


@dataclass
class Lane:
    """One sequence being processed (main.c lane)."""

    cache: object
    busy: bool = False
    story: int = 0
    ids: List[int] = field(default_factory=list)
    n: int = 0
    pos: int = 0
    nll: float = 0.0
    lp: List[float] = field(default_factory=list)


@dataclass
class Totals:
    """KV usage over all steps, in bytes (integers: exact in any order)."""

    steps: int = 0
    bytes_peak: int = 0
    bytes_sum: int = 0
    full_bytes_sum: int = 0


# The reference of every kv_bytes figure: an fp16 cache of every token at
# the same step, whatever the pool's dtype (main.c FULL_CACHE_ELT_BYTES).
FULL_CACHE_ELT_BYTES = 2


class Runner:
    """The model, the lanes' caches, and the forward pass."""

    def __init__(self, model: Llama, caches: list,
                 view: Optional[PoolView] = None, policy: Optional[policies.Policy] = None):
        self.m = model
        self.c = model.c
        self.lanes = [Lane(cache) for cache in caches]
        self.view = view
        self.totals = Totals()
        self.wo64 = None
        if policy is not None and policy.needs & policies.NEEDS_VNORM:
            c = self.c
            self.wo64 = [model.wo(l).double().view(c.dim, c.n_heads, c.head_size)
                         for l in range(c.n_layers)]

    def _gather(self, lanes: List[Lane], layer: int):
        caches = [ln.cache for ln in lanes]
        if isinstance(caches[0], PlainCache):
            return gather_plain(caches, layer)
        g = LayerGather(self.view, len(lanes))
        for b, cache in enumerate(caches):
            g.add(b, cache.layer_lists(layer), cache.policy.per_head)
        try:
            return g.tensors()
        finally:
            for cache in caches:
                cache.release_revives()

    def forward(self, lanes: List[Lane], tokens: List[int]) -> np.ndarray:
        """One token per lane (lane b at its pos with token tokens[b]);
        returns the logits [B, vocab] (fp32)."""
        c = self.c
        pos = [ln.pos for ln in lanes]
        for ln in lanes:
            ln.cache.token_begin(ln.pos)
        dev = self.m.device
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        x = self.m.embed(torch.tensor(tokens, dtype=torch.int64, device=dev))
        for layer in range(c.n_layers):
            q, k, v = self.m.layer_qkv(x, layer, pos_t)
            vn = vnorm_l1(v, self.wo64[layer], c.n_heads) if self.wo64 is not None else None
            for b, ln in enumerate(lanes):
                ln.cache.store(layer, k[b], v[b], vn[b] if vn is not None else None)
            keys, values, lengths = self._gather(lanes, layer)
            att, probs = attend(q, keys, values, lengths, self.m.scale)
            for b, ln in enumerate(lanes):
                ln.cache.attended(layer, probs[b])
            x = self.m.layer_finish(x, att, layer)
        logits = self.m.logits(x).cpu().numpy()
        t = self.totals
        for b, ln in enumerate(lanes):
            u = ln.cache.usage()
            t.steps += 1
            t.bytes_sum += u.bytes
            t.full_bytes_sum += (pos[b] + 1) * c.n_layers * c.kv_dim * 2 * FULL_CACHE_ELT_BYTES
            t.bytes_peak = max(t.bytes_peak, u.bytes)
        return logits

    def end_token(self, lane: Lane, logits: np.ndarray, prefill: bool, defer: bool) -> None:
        lane.cache.token_end(Step(prefill=prefill, defer=defer, logits=logits))

    def close(self) -> None:
        for ln in self.lanes:
            ln.cache.close()


def make_caches(model: Llama, lanes: int, session=None, view: Optional[PoolView] = None,
                policy: Optional[policies.Policy] = None) -> list:
    """`lanes` plain caches, or kvstashd caches of one session when given."""
    if session is None:
        return [PlainCache(model.c, model.device) for _ in range(lanes)]
    return [KvstashCache(model.c, session, view, policy) for _ in range(lanes)]
