"""pool.py - kvstashd's pool as torch tensors: write a token's K/V into the
slots an append names, and gather a list's K/V by its block table, with
INT8 blocks dequantised in torch.

The pool is Session.pool_tensor(): the mapped shared memory on the host
backend, the imported GPU arena on cuda (then every gather and write here
runs on that GPU); every tensor here is a view of it, so a write lands in
the daemon's pool and a gather reads exactly what the daemon holds, with no
kvs_layer_read copy in between. The layouts are kernels/kernels.h's:

* a block holds K, then V, each [kv_heads][block_tokens][head_dim] elements
  of the pool's dtype. A list of all heads addresses token (block, slot) of
  KV head g at row block * R + g * block_tokens + slot of the pool seen as
  rows of head_dim elements (R = rows per block = 2 * kv_heads *
  block_tokens); a per-head list's slots are rows of the block itself
  (row block * R + slot). V is kv_heads * block_tokens rows after K either
  way.
* an INT8 segment's block holds one INT8 block at its start (layout q8 = the
  list's layout with T8 = kv_int8_tokens_per_block tokens): K codes int8
  [H][T8][d], V codes, then at S = roundup16(2 H T8 d) the fp32 scales
  [K/V][H][d]. An element is code * scale in fp32 (kv_dequantize_group_ref),
  as the tiered kv_decode_attention reads it.
* an INT4 / INT2 segment's block holds one low-bit block at its start
  (kernels.h "Low-bit tiers", lowbit_geometry below): packed codes, fp16
  scales and zero points per group of 32 (keys per channel over tokens,
  values per token over channels) and the block's power-of-two shift e. An
  element is (code * scale + zero) * 2^e in fp32, as the kernels read it.
"""
from typing import List, Tuple

import numpy as np
import torch

TIER_FULL, TIER_INT8, TIER_SKETCH, TIER_INT4, TIER_INT2 = 0, 1, 2, 4, 5
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ELT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def int8_block_bytes(heads: int, tokens: int, head_dim: int) -> int:
    """kv_int8_block_bytes: codes, scales at a 16-byte boundary, rounded to 16."""
    scales = (2 * heads * tokens * head_dim + 15) & ~15
    return (scales + 8 * heads * head_dim + 15) & ~15


def int8_tokens_per_block(heads: int, block_tokens: int, head_dim: int, elt: int) -> int:
    """kv_int8_tokens_per_block: the most tokens of an INT8 block of the
    list's layout that fit in one pool block."""
    room = 2 * heads * block_tokens * head_dim * elt
    per = 2 * heads * head_dim
    t = room // per + 1 if per else 1
    while t > 0 and int8_block_bytes(heads, t, head_dim) > room:
        t -= 1
    return t


LOWBIT_GROUP = 32  # KV_LOWBIT_GROUP_DEFAULT, until a table says kvstashd's (--quant-group)


def lowbit_layout(heads: int, tokens: int, head_dim: int, bits: int,
                  group: int = LOWBIT_GROUP) -> dict:
    """The offsets of a low-bit block of `tokens` (kv_lowbit_* of kernels.h)."""
    R = (head_dim * bits + 7) // 8
    codes = heads * tokens * R
    kstart = (2 * codes + 15) & ~15
    nk, nv = -(-tokens // group), -(-head_dim // group)
    vstart = kstart + 4 * heads * nk * head_dim
    shift = vstart + 4 * heads * tokens * nv
    return {"T": tokens, "R": R, "codes": codes, "kstart": kstart, "nk": nk, "nv": nv,
            "vstart": vstart, "shift": shift, "bytes": (shift + 4 + 15) & ~15,
            "group": group, "bits": bits}


def lowbit_geometry(heads: int, block_tokens: int, head_dim: int, elt: int, bits: int,
                    group: int = LOWBIT_GROUP) -> dict:
    """kv_lowbit_tokens_per_block: the largest low-bit block of the list's
    layout that fits one pool block, with its offsets."""
    room = 2 * heads * block_tokens * head_dim * elt
    per = (2 * heads * head_dim * bits + 7) // 8
    t = room // per + 1 if per else 1
    while t > 0 and lowbit_layout(heads, t, head_dim, bits, group)["bytes"] > room:
        t -= 1
    return lowbit_layout(heads, t, head_dim, bits, group)


class ListTokens:
    """A list's tokens in table order, one column each: rows block, slot,
    tier and original position of a [4, n] int64 array (one array, so that
    extending a list by an append and splitting a table are one numpy call)."""

    __slots__ = ("a",)

    def __init__(self, a: np.ndarray):
        self.a = a

    block = property(lambda self: self.a[0])
    slot = property(lambda self: self.a[1])
    tier = property(lambda self: self.a[2])
    pos = property(lambda self: self.a[3])

    @property
    def n(self) -> int:
        return int(self.a.shape[1])

    @staticmethod
    def empty() -> "ListTokens":
        return ListTokens(np.zeros((4, 0), dtype=np.int64))

    @staticmethod
    def from_segments(segments: np.ndarray, positions: np.ndarray) -> "ListTokens":
        """One column per token of a LayerList's segments (block, first_slot,
        count, tier) and its positions."""
        return ListTokens.many([segments], [positions])[0]

    @staticmethod
    def many(segments: List[np.ndarray], positions: List[np.ndarray]) -> List["ListTokens"]:
        """from_segments of many lists at once (one table's): the numpy work
        is done once over all of them, then split."""
        seg = np.concatenate(segments) if len(segments) > 1 else segments[0]
        count = seg["count"].astype(np.int64)
        n = int(count.sum())
        a = np.empty((4, n), dtype=np.int64)
        starts = np.cumsum(count) - count
        a[0] = np.repeat(seg["block"], count)
        a[1] = np.repeat(seg["first_slot"].astype(np.int64) - starts, count)
        a[1] += np.arange(n, dtype=np.int64)
        a[2] = np.repeat(seg["tier"], count)
        a[3] = np.concatenate(positions) if len(positions) > 1 else positions[0]
        out, at = [], 0
        for p in positions:
            out.append(ListTokens(a[:, at:at + p.shape[0]]))
            at += p.shape[0]
        return out

    def concat(self, other: "ListTokens") -> "ListTokens":
        return ListTokens(np.concatenate((self.a, other.a), axis=1))

    def cut(self, idx: np.ndarray) -> "ListTokens":
        """Without the tokens at indices idx (a step's cuts, StepResult.cuts)."""
        return ListTokens(np.delete(self.a, idx, axis=1)) if idx.shape[0] else self

    def move(self, first: int, count: int, block: int, first_slot: int, tier: int) -> None:
        """Tokens [first, first + count) now stored at slots [first_slot,
        first_slot + count) of `block`, in `tier` (a demotion's run,
        Table.moves), in place."""
        self.a[0, first:first + count] = block
        self.a[1, first:first + count] = np.arange(first_slot, first_slot + count, dtype=np.int64)
        self.a[2, first:first + count] = tier

    def with_columns(self, block: np.ndarray, slot: np.ndarray, tier: np.ndarray) -> "ListTokens":
        return ListTokens(np.stack((block, slot, tier, self.pos)))


class PoolView:
    """Torch views of one session's pool for a model's KV layout."""

    def __init__(self, pool, block_bytes: int, kv_heads: int, block_tokens: int,
                 head_dim: int, dtype: str):
        """pool: the whole pool as uint8, a torch tensor (Session.pool_tensor)
        or a numpy array (Session.pool_array)."""
        self.kv_heads, self.block_tokens, self.head_dim = kv_heads, block_tokens, head_dim
        self.dtype = dtype
        self.elt = ELT_BYTES[dtype]
        self.block_bytes = block_bytes
        assert block_bytes == 2 * kv_heads * block_tokens * head_dim * self.elt, \
            "the pool's block size does not match the model's KV layout"
        raw = pool if isinstance(pool, torch.Tensor) else torch.from_numpy(pool)
        self.device = raw.device
        row_bytes = head_dim * self.elt
        usable = raw.shape[0] // row_bytes * row_bytes
        self.rows = raw[:usable].view(TORCH_DTYPES[dtype]).view(-1, head_dim)
        self.codes = raw[:raw.shape[0] // head_dim * head_dim].view(torch.int8).view(-1, head_dim)
        self.floats = raw[:raw.shape[0] // 4 * 4].view(torch.float32)
        self.rows_per_block = block_bytes // row_bytes
        self.v_rows = kv_heads * block_tokens  # V rows follow K rows by this many
        # Per list kind (all heads, per head): INT8 heads H, tokens T8, scale offset S.
        self.q8 = {}
        for per_head in (False, True):
            H = 1 if per_head else kv_heads
            T = block_tokens * kv_heads if per_head else block_tokens
            T8 = int8_tokens_per_block(H, T, head_dim, self.elt)
            self.q8[per_head] = (H, T8, (2 * H * T8 * head_dim + 15) & ~15)
        self.raw = raw
        self.quant_group = 0
        self.set_quant_group(LOWBIT_GROUP)

    def set_quant_group(self, group: int) -> None:
        """The INT4 / INT2 blocks' geometry per list kind and bits, for
        groups of `group` (the tables' quant_group)."""
        if group == self.quant_group:
            return
        kv, T, d = self.kv_heads, self.block_tokens, self.head_dim
        self.qlow = {(per_head, bits): lowbit_geometry(1 if per_head else kv,
                                                       T * (kv if per_head else 1), d, self.elt,
                                                       bits, group)
                     for per_head in (False, True) for bits in (4, 2)}
        self.quant_group = group

    def index(self, a: np.ndarray) -> torch.Tensor:
        """A numpy index array as a tensor on the pool's device."""
        return torch.from_numpy(a).to(self.device)

    def key_rows(self, blocks: np.ndarray, slots: np.ndarray, per_head: bool) -> np.ndarray:
        """K row indices [heads_of_list, n] of full-precision tokens: all KV
        heads for a list of all heads, one row for a per-head list."""
        base = blocks * self.rows_per_block + slots
        if per_head:
            return base[None, :]
        heads = np.arange(self.kv_heads, dtype=np.int64) * self.block_tokens
        return base[None, :] + heads[:, None]

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store fp32 keys and values [m, head_dim] at K rows `rows` [m] (V at
        rows + v_rows), rounded to the pool's dtype (round to nearest even,
        as kv_elt_store)."""
        dt = self.rows.dtype
        self.rows.index_copy_(0, rows, keys.to(dt))
        self.rows.index_copy_(0, rows + self.v_rows, values.to(dt))

    def int8_rows(self, blocks: np.ndarray, slots: np.ndarray, head: np.ndarray,
                  per_head: bool) -> np.ndarray:
        """For INT8 tokens (block, slot, head of the q8 layout): [4, m] =
        the K and V code rows (int8 rows of head_dim bytes) and the first
        floats of the K and V scale rows."""
        H, T8, S = self.q8[per_head]
        d = self.head_dim
        out = np.empty((4, blocks.shape[0]), dtype=np.int64)
        out[0] = blocks * (self.block_bytes // d) + head * T8 + slots
        out[1] = out[0] + H * T8
        out[2] = (blocks * self.block_bytes + S) // 4 + head * d
        out[3] = out[2] + H * d
        return out

    def dequant(self, src: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V [m, head_dim] fp32 of INT8 tokens (int8_rows' [4, m]):
        code * scale, as kv_dequantize_group_ref."""
        t = self.index(src)
        cols = torch.arange(self.head_dim, device=self.device)[None, :]
        k = self.codes.index_select(0, t[0]).float() * self.floats[t[2][:, None] + cols]
        v = self.codes.index_select(0, t[1]).float() * self.floats[t[3][:, None] + cols]
        return k, v


    def _bytes(self, offsets: np.ndarray, n: int) -> torch.Tensor:
        """[m, n] uint8: n bytes of the pool from each offset."""
        idx = self.index(offsets[:, None] + np.arange(n, dtype=np.int64)[None, :])
        return self.raw[idx.reshape(-1)].view(offsets.shape[0], n)

    def lowbit_dequant(self, blocks: np.ndarray, slots: np.ndarray, head: np.ndarray,
                       per_head: bool, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V [m, head_dim] fp32 of INT4 / INT2 tokens (block, slot, head
        of the low-bit layout): (code * scale + zero) * 2^e, as
        kv_lowbit_value reads them."""
        g = self.qlow[(per_head, bits)]
        d, T, G, R, nv = self.head_dim, g["T"], g["group"], g["R"], g["nv"]
        base = blocks.astype(np.int64) * self.block_bytes
        row = (head.astype(np.int64) * T + slots) * R
        kp = base + g["kstart"] + (head.astype(np.int64) * g["nk"] + slots // G) * 4 * d
        vp = base + g["vstart"] + (head.astype(np.int64) * T + slots) * 4 * nv
        shift = self._bytes(base + g["shift"], 4).contiguous().view(torch.int32).clamp(-126, 127)
        p2 = torch.ldexp(torch.ones_like(shift, dtype=torch.float32), shift)  # 2^e, exact

        def codes(off):
            x = self._bytes(off, R).to(torch.int32)
            parts = [(x >> s) & ((1 << bits) - 1) for s in range(0, 8, bits)]
            return torch.stack(parts, dim=-1).reshape(x.shape[0], -1)[:, :d].float()

        def halves(off, n):
            return self._bytes(off, 2 * n).contiguous().view(torch.float16).float()

        cols = torch.arange(d, device=self.device) // G
        k = (codes(base + row) * halves(kp, d) + halves(kp + 2 * d, d)) * p2
        vs, vz = halves(vp, nv)[:, cols], halves(vp + 2 * nv, nv)[:, cols]
        v = (codes(base + g["codes"] + row) * vs + vz) * p2
        return k, v


class LayerGather:
    """The padded K/V of one layer for a batch of lanes: rows (b, g) hold the
    tokens of the list lane b's KV head g reads, in table order.

    Collect with add() per lane, then tensors() gathers from the pool (fp32)."""

    def __init__(self, view: PoolView, lanes: int):
        self.view = view
        self.B = lanes
        self.entries: List[Tuple[int, List[ListTokens], bool]] = []

    def add(self, lane: int, lists: List[ListTokens], per_head: bool) -> None:
        """lists: the layer's one list, or its kv_heads per-head lists."""
        self.entries.append((lane, lists, per_head))

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [B, kv_heads, N, head_dim] fp32 (padding zeroed) and
        lengths [B, kv_heads]."""
        v = self.view
        KV, d = v.kv_heads, v.head_dim
        lengths = np.zeros((self.B, KV), dtype=np.int64)
        for lane, lists, per_head in self.entries:
            for g in range(KV):
                lengths[lane, g] = lists[g if per_head else 0].n
        N = int(lengths.max()) if lengths.size else 0
        idx = np.zeros((self.B, KV, N), dtype=np.int64)
        int8_at: List[np.ndarray] = []  # flat (b, g, i) indices of INT8 tokens
        int8_src: List[np.ndarray] = []  # their int8_rows
        low: List[Tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []  # INT4 / INT2: at, k, v
        heads_all = np.arange(KV, dtype=np.int64)
        for lane, lists, per_head in self.entries:
            for g in (range(KV) if per_head else [0]):
                lt = lists[g]
                n = lt.n
                rows = v.key_rows(lt.block, lt.slot, per_head)  # [1 or KV, n]
                full = lt.tier == TIER_FULL
                if per_head:
                    idx[lane, g, :n] = np.where(full, rows[0], 0)
                else:
                    idx[lane, :, :n] = np.where(full[None, :], rows, 0)
                if full.all():
                    continue
                assert not (lt.tier == TIER_SKETCH).any(), "sketch tokens must be revived first"
                for tier, bits in ((TIER_INT4, 4), (TIER_INT2, 2)):
                    q = np.nonzero(lt.tier == tier)[0]
                    if q.shape[0] == 0:
                        continue
                    if per_head:
                        heads, tok, at = np.zeros_like(q), q, (lane * KV + g) * N + q
                    else:
                        heads, tok = np.repeat(heads_all, q.shape[0]), np.tile(q, KV)
                        at = (lane * KV + heads) * N + tok
                    k4, v4 = v.lowbit_dequant(lt.block[tok], lt.slot[tok], heads, per_head, bits)
                    low.append((at, k4, v4))
                q = np.nonzero(lt.tier == TIER_INT8)[0]
                if q.shape[0] == 0:
                    continue
                if per_head:  # one head of the list's own rows layout: head 0 of q8
                    heads, tok = np.zeros_like(q), q
                    int8_at.append((lane * KV + g) * N + q)
                else:  # every KV head of each INT8 token
                    heads, tok = np.repeat(heads_all, q.shape[0]), np.tile(q, KV)
                    int8_at.append((lane * KV + heads) * N + tok)
                int8_src.append(v.int8_rows(lt.block[tok], lt.slot[tok], heads, per_head))
        flat = v.index(idx.reshape(-1))
        keys = v.rows.index_select(0, flat).float().view(self.B, KV, N, d)
        values = v.rows.index_select(0, flat + v.v_rows).float().view(self.B, KV, N, d)
        if int8_at:
            k8, v8 = v.dequant(np.concatenate(int8_src, axis=1))
            at = v.index(np.concatenate(int8_at))
            keys.view(-1, d).index_copy_(0, at, k8)
            values.view(-1, d).index_copy_(0, at, v8)
        for at_np, k4, v4 in low:
            at = v.index(at_np)
            keys.view(-1, d).index_copy_(0, at, k4)
            values.view(-1, d).index_copy_(0, at, v4)
        lengths_t = v.index(lengths)
        valid = torch.arange(N, device=v.device).view(1, 1, N) < lengths_t.view(self.B, KV, 1)
        keys = keys.masked_fill(~valid[..., None], 0.0)
        values = values.masked_fill(~valid[..., None], 0.0)
        return keys, values, lengths_t


def new_rows(view: PoolView, writes: List[Tuple[int, int]], per_head: bool) -> np.ndarray:
    """K rows [kv_heads] where one new token's heads go: writes are the
    (block, slot) of the token in the layer's one list, or in each KV head's
    list (per-head), as the append answered."""
    if per_head:
        return np.array([b * view.rows_per_block + s for b, s in writes], dtype=np.int64)
    b, s = writes[0]
    return b * view.rows_per_block + s + np.arange(view.kv_heads, dtype=np.int64) * \
        view.block_tokens

