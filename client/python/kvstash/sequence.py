"""sequence.py - one sequence of a session: append, write, read, step,
epoch, table, revive, release (the kvs_seq_* calls).

Appends, steps and epoch checks go through the session's shared-memory
ring, so they are the per-token path: they build as little Python as they
can (a Table builds its lists only when asked). Tables follow the epoch
rule of client/kvstash.h: read through the newest table you got before the
next call on the sequence.
"""
import ctypes
from typing import Optional, Sequence as Seq, Tuple

import numpy as np

from . import _lib, kvio, stepstats
from .errors import InvalidArgument, end_with_block
from .session import Session
from .table import LayerList, StepResult, Table

ArrayList = Optional[Seq[np.ndarray]]


class Sequence:
    """A sequence created by Session.create_sequence; a context manager
    whose exit releases it (also when an exception leaves the block)."""

    def __init__(self, session: Session, seq_id: int, policy: str):
        self.session = session
        self.id = seq_id
        self.policy = policy
        self.released = False
        self._lib = session._lib
        self._heads = 1  # lists per layer, as the last table said
        self._plain_step = _lib.Step_(heads=1, confidence=-1.0)  # step() without arrays

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.released or not self.session.attached:
            return
        end_with_block(self.release, exc_type is not None)

    def release(self) -> None:
        """kvs_seq_release: give the sequence's blocks back."""
        rc = self._lib.kvs_seq_release(self.session.handle(), self.id)
        if rc:
            self.session.raise_for(rc)
        self.released = True

    # ---- the per-step path (the ring) ----

    def append(self, count: int) -> Table:
        """kvs_seq_append: room for `count` new tokens in every list. The
        Table's lists say where they go (write them with write(), or through
        Session.block_keys/block_values)."""
        c = _lib.Table_()
        rc = self._lib.kvs_seq_append(self.session.handle(), self.id, count, ctypes.byref(c))
        if rc:
            self.session.raise_for(rc)
        t = Table(c)
        self._heads = t.heads
        return t

    def step(self, new_tokens: int = 0, prefill: bool = False, tokens: Optional[Seq[int]] = None,
             score: ArrayList = None, score_queries: int = 0, last_attn: ArrayList = None,
             window_attn: ArrayList = None, window_queries: int = 0, vnorm: ArrayList = None,
             confidence: Optional[float] = None) -> StepResult:
        """kvs_seq_step: end a step and report its statistics.

        score: [layers] float32 arrays (one per layer's list); last_attn,
        window_attn: [layers * q_heads]; vnorm: [layers * kv_heads]; each
        holds one float per token of the list it reads, after the step's
        appends. tokens: held tokens per list ([layers * heads]); None reads
        them off the arrays. Shapes are checked before the call
        (InvalidArgument)."""
        if (tokens is None and score is None and last_attn is None and window_attn is None and
                vnorm is None):
            # The per-token path of policies that need nothing: no arrays to check.
            st = self._plain_step
            st.new_tokens = stepstats.u32("new_tokens", new_tokens)
            st.prefill = 1 if prefill else 0
            st.confidence = -1.0 if confidence is None else float(confidence)
            c_step = ctypes.byref(st)
        else:
            g = self.session.geometry
            heads = self._lists_per_layer(tokens)
            args = stepstats.build(g.layers, g.q_heads, g.kv_heads, heads, new_tokens, prefill,
                                   tokens, (score, last_attn, window_attn, vnorm), score_queries,
                                   window_queries, confidence)
            c_step = ctypes.byref(args.c)
        res = _lib.StepResult_()
        rc = self._lib.kvs_seq_step(self.session.handle(), self.id, c_step, ctypes.byref(res))
        if rc:
            self.session.raise_for(rc)
        return StepResult.from_c(res)

    def _lists_per_layer(self, tokens: Optional[Seq[int]]) -> int:
        """A step's lists per layer: kv_heads when tokens counts that many
        a layer, else what the last table said."""
        g = self.session.geometry
        if tokens is not None and g.kv_heads > 1 and len(tokens) == g.layers * g.kv_heads:
            return g.kv_heads
        return self._heads

    def step_rows(self, tokens: Seq[int], score: bool = False, last_attn: bool = False,
                  window_attn: bool = False, vnorm: bool = False) -> stepstats.StepRows:
        """kvs_step_in_ring: the rows of a step's statistics inside the
        session's ring, for a worker that writes them there itself and so
        spares step() their copy (4 MiB a decode step of `score` at 32
        layers x 32k tokens, 128 MiB of `last_attn`). tokens: held tokens
        per list after the step's appends ([layers * heads]); ask after the
        appends, fill the arrays, then pass them to step() with the same
        tokens. InvalidArgument when they do not fit the ring (kvstashd
        --ring-mb)."""
        g = self.session.geometry
        heads = self._lists_per_layer(tokens)
        tok = stepstats._tokens_array(tokens, g.layers * heads)
        arrays = ((1 if score else 0) | (2 if last_attn else 0) | (4 if window_attn else 0) |
                  (8 if vnorm else 0))
        if arrays == 0:
            raise InvalidArgument("step_rows: ask for at least one of score, last_attn, "
                                  "window_attn, vnorm")
        c = _lib.StepRows_()
        rc = self._lib.kvs_step_in_ring(self.session.handle(), heads,
                                        tok.ctypes.data_as(_lib.c_uint32_p), arrays,
                                        ctypes.byref(c))
        if rc:
            self.session.raise_for(rc)
        return stepstats.rows_in_ring(self.session, c, g.layers, g.q_heads, g.kv_heads, heads,
                                      tok)

    def epoch(self) -> int:
        """kvs_seq_epoch: the current table epoch (has my table changed?)."""
        e = ctypes.c_uint64()
        rc = self._lib.kvs_seq_epoch(self.session.handle(), self.id, ctypes.byref(e))
        if rc:
            self.session.raise_for(rc)
        return e.value

    # ---- tables and K/V ----

    def table(self, with_positions: bool = True) -> Table:
        """kvs_seq_table: every list the sequence holds now."""
        c = _lib.Table_()
        rc = self._lib.kvs_seq_table(self.session.handle(), self.id, 1 if with_positions else 0,
                                     ctypes.byref(c))
        if rc:
            self.session.raise_for(rc)
        t = Table(c)
        self._heads = t.heads
        return t

    def write(self, lst: LayerList, k, v) -> None:
        """kvs_layer_write: copy k and v ([kv_heads][tokens][head_dim], or
        [tokens][head_dim] for a per-head list, of the pool's dtype) into the
        list's segments (an append's)."""
        kvio.write(self.session, lst, k, v)

    def read(self, lst: LayerList, out: Optional[Tuple[np.ndarray, np.ndarray]] = None
             ) -> Tuple[np.ndarray, np.ndarray]:
        """kvs_layer_read: the list's K and V as new arrays (or into `out`),
        INT8 segments dequantised. A list with sketch segments cannot be read
        in place: FailedPrecondition (use revive)."""
        return kvio.read(self.session, lst, out)

    # ---- revive ----

    def revive(self, layer: int = 0, head: int = 0, first: int = 0, count: int = 0,
               skip_evicted: bool = False, in_place: bool = False) -> "Revive":
        """kvs_seq_revive: rebuild original positions [first, first + count)
        (count 0: to the end) of list (layer, head) in full precision, in
        scratch blocks. A context manager whose exit gives them back.
        in_place: tokens held at full precision are not copied; the list
        names their own slots (read them, never write them), readable until
        the session acks an epoch after Revive.epoch."""
        r = _lib.Revive_()
        flags = (_lib.REVIVE_SKIP_EVICTED if skip_evicted else 0) | \
            (_lib.REVIVE_IN_PLACE if in_place else 0)
        rc = self._lib.kvs_seq_revive(self.session.handle(), self.id, layer, head, first, count,
                                      flags, ctypes.byref(r))
        if rc:
            self.session.raise_for(rc)
        return Revive(self.session, r)

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, policy={self.policy!r}, released={self.released})"


class Revive:
    """A revived list (kvs_revive): table (its Table), list (the revived
    LayerList, positions filled), source_tier (uint8 per token: where it was
    stored), from_full / from_int8 / from_sketch (token counts), epoch (the
    sequence's table epoch when it was revived).

    Its scratch blocks stay held until release() (or the end of the with
    block), or until the session ends: garbage collection does not call the
    daemon."""

    def __init__(self, session: Session, c: _lib.Revive_):
        self.session = session
        self._c = c
        self.scratch_id: int = c.scratch_id
        self.table = Table(c.table, free=False)
        idx = ctypes.addressof(c.layer.contents) - ctypes.addressof(c.table.layer.contents)
        self.list: LayerList = self.table.lists[idx // ctypes.sizeof(_lib.Layer_)]
        n = self.list.tokens
        if n:
            raw = ctypes.cast(c.source_tier, ctypes.POINTER(ctypes.c_uint8 * n)).contents
            self.source_tier = np.frombuffer(raw, dtype=np.uint8).copy()
        else:
            self.source_tier = np.zeros(0, dtype=np.uint8)
        self.from_full: int = c.from_full
        self.from_int8: int = c.from_int8
        self.from_sketch: int = c.from_sketch
        self.epoch: int = c.epoch
        self.released = False

    def read(self) -> Tuple[np.ndarray, np.ndarray]:
        """The revived K and V (as Sequence.read of the list)."""
        if self.released:
            raise InvalidArgument("revive: already released")
        return kvio.read(self.session, self.list)

    def release(self) -> None:
        """kvs_revive_release: give the scratch blocks back."""
        if self.released:
            return
        self.released = True
        rc = self.session._lib.kvs_revive_release(self.session.handle(), ctypes.byref(self._c))
        if rc:
            self.session.raise_for(rc)

    def __enter__(self) -> "Revive":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.session.attached:
            return
        end_with_block(self.release, exc_type is not None)
