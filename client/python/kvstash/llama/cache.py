"""cache.py - the KV cache of one sequence (a lane): kvstashd through the
kvstash binding, or a plain in-process array (the reference, --no-daemon).

This is client/llama/cache.c in Python. Per token the forward pass calls:
  token_begin(pos)        room for the token (kvstashd: Append), following
                          the table by its epoch;
  store(layer, k, v, vn)  the token's K/V into the slots the append named
                          (kvstashd: straight into the pool's views);
  lists(layer)            what the token attends over (the batch gathers
                          every lane's lists from the pool in one go);
  attended(layer, probs)  this query's attention, kept for the statistics;
  token_end(step)         report the step to the policy (Step) and re-read
                          the table when the epoch moved.

The statistics are the ones the policy asks for (policies.POLICIES), as
cache.c computes them: score (sum over query heads), last_attn, window_attn
(the mean over the last `window` queries, from running sums by position),
vnorm (||V W^O||_1 per token and KV head, computed once when written) and
confidence (confkv_confidence_logits of the step's logits). A prompt is one
step: its tokens but the last are deferred (appended and attended, no
step), and the last ends the step with prefill set.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from . import policies
from .checkpoint import Config
from .pool import (TIER_FULL, TIER_INT2, TIER_INT4, TIER_INT8, TIER_SKETCH, ListTokens, PoolView,
                   new_rows)


class CacheError(RuntimeError):
    """A runtime failure of the cache (exit status 1)."""


@dataclass
class Usage:
    """What the cache held when the last token attended."""

    tokens: int = 0   # summed over the lists of every layer
    bytes: int = 0    # what the sequence holds: whole pool blocks, sketch cells, victims
    evicted: int = 0  # tokens the policy removed in this sequence so far


@dataclass
class Step:
    """What a token ends (cache.h cache_step)."""

    prefill: bool = False   # the step ends a prompt
    defer: bool = False     # a prompt token before the last: no step yet
    logits: Optional[np.ndarray] = None  # the step's next-token logits (confidence)


class PlainCache:
    """The in-process reference: [layer][position][kv_heads][head_dim] fp32
    and every token attended, no eviction."""

    plain = True

    def __init__(self, c: Config, device: torch.device = torch.device("cpu")):
        self.c = c
        self.keys = torch.zeros(c.n_layers, c.seq_len, c.n_kv_heads, c.head_size, device=device)
        self.values = torch.zeros_like(self.keys)
        self.pos = 0
        self.usage_ = Usage()

    def seq_begin(self, label: str) -> None:
        self.pos = 0
        self.usage_ = Usage()

    def seq_end(self) -> None:
        pass

    def token_begin(self, pos: int) -> None:
        if pos >= self.c.seq_len:
            raise CacheError(f"position {pos} is past the model's context ({self.c.seq_len})")
        self.pos = pos

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              vnorm: Optional[np.ndarray]) -> None:
        self.keys[layer, self.pos] = k
        self.values[layer, self.pos] = v

    def attended(self, layer: int, probs: torch.Tensor) -> None:
        pass

    def token_end(self, step: Step) -> None:
        pass

    def usage(self) -> Usage:
        c = self.c
        tokens = (self.pos + 1) * c.n_layers
        self.usage_.tokens = tokens
        self.usage_.bytes = tokens * c.n_kv_heads * 2 * c.head_size * 4
        return self.usage_

    def close(self) -> None:
        pass


def gather_plain(caches: List[PlainCache], layer: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded K/V [B, kv_heads, N, hs] and lengths [B, kv_heads] of plain caches."""
    n = [c.pos + 1 for c in caches]
    N = max(n)
    keys = torch.stack([c.keys[layer, :N] for c in caches]).transpose(1, 2)
    values = torch.stack([c.values[layer, :N] for c in caches]).transpose(1, 2)
    kv = caches[0].c.n_kv_heads
    lengths = torch.tensor(n, dtype=torch.int64, device=keys.device)[:, None].expand(len(caches), kv)
    return keys, values, lengths


class KvstashCache:
    """One sequence at a time in kvstashd, under one policy (cache.c)."""

    plain = False

    def __init__(self, c: Config, session, view: PoolView, policy: policies.Policy):
        self.c, self.s, self.view, self.policy = c, session, view, policy
        self.L, self.Q, self.KV, self.D = c.n_layers, c.n_heads, c.n_kv_heads, c.head_size
        self.G = self.Q // self.KV
        self.ctx = c.seq_len
        self.heads = self.KV if policy.per_head else 1
        self.needs = policy.needs
        self.seq = None
        self.lists: List[ListTokens] = []
        self.moved = 0  # demotions followed from an append's answer, not a table read
        self.sketched: List[int] = []
        self.epoch: Optional[int] = None
        self.writes = None  # the last append's Table
        self.pos = 0
        self.usage_ = Usage()
        self.p_last: List[Optional[np.ndarray]] = [None] * (self.L * self.Q)
        self.revives: list = []
        self.revived_lists = 0  # lists whose sketch tokens were revived to attend (all time)
        self.window = policy.window
        if self.needs & policies.NEEDS_WINDOW_ATTN:
            self.whist = np.zeros((self.window, self.L, self.Q, self.ctx), dtype=np.float32)
            self.wsum = np.zeros((self.L, self.Q, self.ctx), dtype=np.float32)
        self.wfill = self.wnext = 0
        self.p_window: List[np.ndarray] = []
        self.vn = np.zeros((self.L, self.KV, self.ctx), dtype=np.float32)
        self.block_bytes = view.block_bytes
        self.beyond_table = policy.holds_beyond_table()

    # ---- sequences ----

    def seq_begin(self, label: str) -> None:
        if self.seq is not None:
            raise CacheError("a sequence is already open")
        self.usage_ = Usage()
        self.pos = 0
        self.seq = self.s.create_sequence(policy=self.policy.name,
                                          params=dict(self.policy.params), label=label)
        self.lists = [ListTokens.empty() for _ in range(self.L * self.heads)]
        self.sketched = [0] * (self.L * self.heads)
        self.epoch = None  # unknown: the first append reads the table
        self.wfill = self.wnext = 0
        if self.needs & policies.NEEDS_WINDOW_ATTN:
            self.wsum.fill(0.0)
            self.whist.fill(0.0)

    def seq_end(self) -> None:
        if self.seq is None:
            return
        seq, self.seq, self.writes = self.seq, None, None
        seq.release()

    def close(self) -> None:
        self.seq_end()

    # ---- the table ----

    def _reload(self) -> None:
        """Replace the lists with the daemon's current table."""
        t = self.seq.table(with_positions=True)
        if t.heads != self.heads or len(t.lists) != self.L * self.heads:
            raise CacheError(f"the daemon's table has {t.heads} lists per layer; policy "
                             f"{self.policy.name} wants {self.heads}")
        lists = t.lists
        self.lists = ListTokens.many([ly.segments for ly in lists],
                                     [ly.positions for ly in lists])
        for i, ly in enumerate(lists):
            seg = ly.segments
            self.sketched[i] = int(seg["count"][seg["tier"] == TIER_SKETCH].sum())
            if ly.quant_group:  # the daemon's --quant-group: how its INT4 / INT2 blocks read
                self.view.set_quant_group(ly.quant_group)
        self.epoch = t.epoch

    def _extend(self, w) -> None:
        """Add an append's new tokens at the lists' tails (full precision)."""
        lists = w.lists
        pos = [ly.positions if ly.positions is not None else
               np.arange(w.first_position, w.first_position + ly.tokens, dtype=np.int64)
               for ly in lists]
        new = ListTokens.many([ly.segments for ly in lists], pos)
        self.lists = [old.concat(add) for old, add in zip(self.lists, new)]

    def _move(self, runs: np.ndarray) -> bool:
        """Apply a demotion's runs (Table.moves) to the lists; False, and
        nothing changed, when one does not fit them."""
        for r in runs:
            if r["list"] >= len(self.lists) or r["first"] + r["count"] > self.lists[r["list"]].n:
                return False
        for r in runs:
            self.lists[r["list"]].move(int(r["first"]), int(r["count"]), int(r["block"]),
                                       int(r["first_slot"]), int(r["tier"]))
        return True

    def catch_up(self) -> None:
        """Follow a table change published after the last step's answer (a
        demotion that step left due, which its answer could not name): ask
        the epoch (kvs_seq_epoch waits for the demotion) and read the table
        again if it moved. A forward pass need not: its next token_begin
        learns the epoch from the append."""
        if self.seq is not None and self.epoch is not None and self.seq.epoch() != self.epoch:
            self._reload()

    def token_begin(self, pos: int) -> None:
        if pos >= self.ctx:
            raise CacheError(f"position {pos} is past the model's context ({self.ctx})")
        self.pos = pos
        w = self.seq.append(1)
        self.writes = w
        if w.heads != self.heads:
            raise CacheError(f"Append answered {w.heads} lists per layer, policy "
                             f"{self.policy.name} wants {self.heads}")
        self.usage_.evicted += w.evicted
        # An append is one epoch, after the demotion published since the
        # last step's answer when it names the runs it moved; anything more
        # (a silent step evicted, a list compacted) means the table changed
        # under us: read it again.
        moves = w.moves()
        if (moves is not None and moves.from_epoch == self.epoch and
                moves.to_epoch + 1 == w.epoch and w.evicted == 0 and self._move(moves.runs)):
            self.moved += 1
            self.epoch = w.epoch
            self._extend(w)
        elif w.evicted == 0 and self.epoch is not None and w.epoch == self.epoch + 1:
            self.epoch = w.epoch
            self._extend(w)
        else:
            self._reload()

    # ---- one layer ----

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              vnorm: Optional[np.ndarray]) -> None:
        """Write the token's K/V (fp32 [kv_heads, hs]) where the append said."""
        if vnorm is not None:
            self.vn[layer, :, self.pos] = vnorm
        lists = self.writes.lists[layer * self.heads:(layer + 1) * self.heads]
        at = []
        for ly in lists:
            seg = ly.segments
            if ly.tokens != 1 or seg.shape[0] != 1 or seg["tier"][0] != TIER_FULL:
                raise CacheError(f"Append's list of layer {layer} has {ly.tokens} tokens in "
                                 f"{seg.shape[0]} segments; expected one full-precision slot")
            at.append((int(seg["block"][0]), int(seg["first_slot"][0])))
        rows = self.view.index(new_rows(self.view, at, self.policy.per_head))
        self.view.write(rows, k, v)

    def layer_lists(self, layer: int) -> List[ListTokens]:
        """The layer's lists as attention must read them: sketch tokens
        revived into scratch blocks (released by release_revives)."""
        out = []
        for h in range(self.heads):
            i = layer * self.heads + h
            lt = self.lists[i]
            out.append(lt if self.sketched[i] == 0 else self._revived(layer, h, lt))
        return out

    def _revived(self, layer: int, head: int, lt: ListTokens) -> ListTokens:
        """cache.c list_resolve: revive the positions the list keeps in the
        sketch (from the first to the last; full-precision tokens between
        them stay in place), and point those tokens at their rebuilt K/V;
        revived tokens come in position order, like the list's."""
        sk = lt.tier == TIER_SKETCH
        lo, hi = int(lt.pos[sk].min()), int(lt.pos[sk].max())
        rv = self.seq.revive(layer=layer, head=head, first=lo, count=hi - lo + 1,
                             skip_evicted=True, in_place=True)
        self.revives.append(rv)
        self.revived_lists += 1
        got = ListTokens.from_segments(rv.list.segments, rv.list.positions)
        where = np.searchsorted(got.pos, lt.pos[sk])
        if (where >= got.n).any() or (got.pos[np.minimum(where, got.n - 1)] != lt.pos[sk]).any():
            raise CacheError(f"Revive of layer {layer} head {head} did not rebuild every "
                             f"sketched position in [{lo}, {hi}]")
        block, slot, tier = lt.block.copy(), lt.slot.copy(), lt.tier.copy()
        block[sk], slot[sk], tier[sk] = got.block[where], got.slot[where], TIER_FULL
        return lt.with_columns(block, slot, tier)

    def release_revives(self) -> None:
        for rv in self.revives:
            rv.release()
        self.revives = []

    def attended(self, layer: int, probs: torch.Tensor) -> None:
        """Keep this query's attention per query head (probs [KV, G, N])."""
        if not self.needs:
            return
        p = probs.cpu().numpy()
        for h in range(self.Q):
            g, j = divmod(h, self.G)
            n = self.lists[layer * self.heads + (g if self.heads > 1 else 0)].n
            self.p_last[layer * self.Q + h] = p[g, j, :n]

    # ---- the step ----

    def _list_of_head(self, layer: int, h: int) -> ListTokens:
        return self.lists[layer * self.heads + (h // self.G if self.heads > 1 else 0)]

    def _stats_window(self, send: bool) -> None:
        """Fold this query into the window's running sums (dense by
        position), then read the window's mean for every held token."""
        slot = self.wnext
        self.wnext = (self.wnext + 1) % self.window
        if self.wfill < self.window:
            self.wfill += 1
        hist = self.whist[slot]  # contiguous: [L][Q][ctx]
        self.wsum -= hist  # the query leaving the window
        hist.fill(0.0)
        # Every (layer, query head) row at once: flat indices lh * ctx + position.
        rows = [self._list_of_head(layer, h).pos + (layer * self.Q + h) * self.ctx
                for layer in range(self.L) for h in range(self.Q)]
        idx = np.concatenate(rows)
        p = np.concatenate(self.p_last)
        hist.reshape(-1)[idx] = p  # positions are distinct within a row
        flat = self.wsum.reshape(-1)
        flat[idx] += p
        out = []
        if send:
            m = flat[idx] / np.float32(self.wfill)
            m = np.where(m > 0, m, np.float32(0.0))  # running sums may drift below 0
            at = 0
            for r in rows:
                out.append(m[at:at + r.shape[0]])
                at += r.shape[0]
        self.p_window = out

    def token_end(self, step: Step) -> None:
        needs = self.needs
        if needs & policies.NEEDS_WINDOW_ATTN:
            self._stats_window(not step.defer)
        if step.defer:
            return
        tokens = [lt.n for lt in self.lists]
        score = last = window = vnorm = None
        computed = needs & (policies.NEEDS_SCORE | policies.NEEDS_VNORM)
        # What is computed here goes straight into the step's rows in the
        # ring (no call to the daemon comes before the step); the query's
        # attention and the window's mean, made earlier, are copied there.
        rows = self.seq.step_rows(
            tokens, score=bool(needs & policies.NEEDS_SCORE),
            last_attn=bool(needs & policies.NEEDS_LAST_ATTN),
            window_attn=bool(needs & policies.NEEDS_WINDOW_ATTN),
            vnorm=bool(needs & policies.NEEDS_VNORM)) if computed else None
        if needs & policies.NEEDS_SCORE:
            score = rows.score
            for l in range(self.L):
                np.sum(np.stack(self.p_last[l * self.Q:(l + 1) * self.Q]), axis=0,
                       dtype=np.float32, out=score[l])
        if needs & policies.NEEDS_LAST_ATTN:
            last = self.p_last
        if needs & policies.NEEDS_WINDOW_ATTN:
            window = self.p_window
        if needs & policies.NEEDS_VNORM:
            vnorm = rows.vnorm
            for l in range(self.L):
                for g in range(self.KV):
                    pos = self.lists[l * self.heads + (g if self.heads > 1 else 0)].pos
                    np.take(self.vn[l, g], pos, out=vnorm[l * self.KV + g])
        conf = None
        if needs & policies.NEEDS_CONFIDENCE and step.logits is not None:
            c = policies.confidence(step.logits, self.policy.weights)
            conf = c if c >= 0.0 else None
        res = self.seq.step(new_tokens=0, prefill=step.prefill, tokens=tokens, score=score,
                            score_queries=1, last_attn=last, window_attn=window,
                            window_queries=0, vnorm=vnorm, confidence=conf)
        self.usage_.evicted += res.evicted
        if res.cuts is not None and res.cut_epoch == self.epoch:
            # Removing tokens was all the step did: cut them out here, as
            # the daemon did, instead of reading the whole table again.
            self.lists = [lt.cut(idx) for lt, idx in zip(self.lists, res.cuts)]
            self.epoch = res.epoch
        elif res.epoch != self.epoch:
            self._reload()

    # ---- usage ----

    def usage(self) -> Usage:
        """Held tokens and their bytes as stored (cache.c usage_now): every
        pool block a list holds counts whole, full precision or quantised
        (an INT8, INT4 or INT2 block and its parameters fill one pool
        block); where the sequence
        can also hold sketch cells or offloaded victims, the daemon's Stats
        count instead (one call per token, so only there)."""
        tokens, blocks = 0, 0
        for lt in self.lists:
            tokens += lt.n
            for tier in (TIER_FULL, TIER_INT8, TIER_INT4, TIER_INT2):
                blocks += int(np.unique(lt.block[lt.tier == tier]).shape[0])
        self.usage_.tokens = tokens
        self.usage_.bytes = blocks * self.block_bytes
        if self.beyond_table and self.seq is not None:
            self.usage_.bytes = self._daemon_bytes()
        return self.usage_

    def _daemon_bytes(self) -> int:
        """The sequence's bytes by the daemon's own count: every tier's pool
        blocks, sketch cells, offloaded victims."""
        from ..stats import stats
        for sq in stats(self.s.socket).get("sequences", []):
            if int(sq.get("seq_id", -1)) == self.seq.id:
                return sum(int(t.get("bytes", 0)) for t in sq.get("tiers", []))
        raise CacheError(f"Stats does not list sequence {self.seq.id}")


def _llround(x: float) -> int:
    """C's llround: halves away from zero."""
    return int(np.floor(x + 0.5)) if x >= 0 else -int(np.floor(-x + 0.5))


def vnorm_l1(v: torch.Tensor, wo64: torch.Tensor, q_heads: int) -> np.ndarray:
    """kv_vnorm_l1 of one new token per lane: out[b][g] = (1/G) sum over the
    group's query heads h of sum_c |sum_j V[b][g][j] wo[c][h*d + j]|, in
    double. v [B, KV, hs] fp32; wo64 [dim, q_heads, hs] float64."""
    B, KV, d = v.shape
    G = q_heads // KV
    vh = v.double().repeat_interleave(G, dim=1)  # [B, Q, d]: the KV head of each query head
    dots = torch.einsum("bhj,chj->bhc", vh, wo64)
    per_head = dots.abs().sum(dim=2)  # [B, Q]
    return (per_head.view(B, KV, G).sum(dim=2) / G).float().cpu().numpy()
