"""stepstats.py - a step's statistics checked and laid out as kvs_step.

The daemon rejects a step whose arrays do not match the table it holds, but
then the whole step is lost and the message names floats, not arrays. So the
binding checks first, without a call: each array has the count the protocol
says (proto/kvstash_step.h) and each row the tokens of the list it reads. A
mistake raises InvalidArgument naming the array and the row.

Row r of `last_attn` / `window_attn` is query head r % q_heads of layer
r // q_heads; it reads the layer's one list, or, per head, KV head
(r % q_heads) // (q_heads // kv_heads)'s list. `vnorm` rows are per KV head,
`score` rows per layer (reading the layer's first list).
"""
import ctypes
from typing import List, Optional, Sequence as Seq, Tuple

import numpy as np

from . import _lib
from .errors import InvalidArgument

# (argument name, rows per layer: "1" | "q" | "kv"), in kvs_step order.
KINDS = (("score", "1"), ("last_attn", "q"), ("window_attn", "q"), ("vnorm", "kv"))


def _row_list(kind_rows: str, row: int, heads: int, q_heads: int, kv_heads: int) -> int:
    """step_row_list: which of a layer's lists row `row` reads."""
    if heads <= 1 or kind_rows == "1":
        return 0
    if kind_rows == "kv":
        return row
    return row // max(1, q_heads // kv_heads)


class StepArgs:
    """A kvs_step and the Python objects its pointers point into (kept
    alive as long as this object)."""

    __slots__ = ("c", "_keep")

    def __init__(self) -> None:
        self.c = _lib.Step_()
        self._keep: List[object] = []


def build(geo_layers: int, q_heads: int, kv_heads: int, heads: int, new_tokens: int,
          prefill: bool, tokens: Optional[Seq[int]], arrays: Tuple[Optional[Seq], ...],
          score_queries: int, window_queries: int, confidence: Optional[float]) -> StepArgs:
    """Check the statistics and build the kvs_step. `arrays` is (score,
    last_attn, window_attn, vnorm), each None or a sequence of 1-D float
    arrays. `tokens` (held tokens per list, [layers * heads]) may be None: it
    is then read from the arrays' lengths, which must agree wherever two
    rows read one list."""
    out = StepArgs()
    st = out.c
    st.new_tokens = u32("new_tokens", new_tokens)
    st.prefill = 1 if prefill else 0
    st.heads = heads
    st.score_queries = u32("score_queries", score_queries)
    st.window_queries = u32("window_queries", window_queries)
    st.confidence = -1.0 if confidence is None else float(confidence)
    present = [a is not None for a in arrays]
    if not any(present):
        if tokens is not None:
            out._keep.append(_tokens_array(tokens, geo_layers * heads))
            st.tokens = out._keep[-1].ctypes.data_as(_lib.c_uint32_p)
        return out
    per_layer = {"1": 1, "q": q_heads, "kv": kv_heads}
    counts: List[Optional[int]] = [None] * (geo_layers * heads)
    if tokens is not None:
        counts = [int(t) for t in _tokens_array(tokens, geo_layers * heads)]
    inferred = tokens is None
    rows_of: List[Optional[List[np.ndarray]]] = []
    for (name, kind), arr in zip(KINDS, arrays):
        if arr is None:
            rows_of.append(None)
            continue
        n_rows = per_layer[kind]
        if len(arr) != geo_layers * n_rows:
            raise InvalidArgument(f"step: {name} has {len(arr)} arrays; the geometry needs "
                                  f"{geo_layers * n_rows} ({geo_layers} layers x {n_rows})")
        rows = []
        for i, a in enumerate(arr):
            row = np.ascontiguousarray(a, dtype=np.float32)
            if row.ndim != 1:
                raise InvalidArgument(f"step: {name}[{i}] has shape {row.shape}; expected one "
                                      f"float per held token")
            layer, r = divmod(i, n_rows)
            lst = layer * heads + _row_list(kind, r, heads, q_heads, kv_heads)
            if counts[lst] is None and inferred:
                counts[lst] = row.shape[0]
            if row.shape[0] != counts[lst]:
                what = "the list's other arrays say" if inferred else "tokens says"
                raise InvalidArgument(f"step: {name}[{i}] (layer {layer}, row {r}) has "
                                      f"{row.shape[0]} values; {what} list {lst} holds "
                                      f"{counts[lst]} tokens")
            rows.append(row)
        rows_of.append(rows)
    if any(c is None for c in counts):
        missing = [i for i, c in enumerate(counts) if c is None]
        raise InvalidArgument(f"step: the arrays do not say how many tokens lists {missing} "
                              f"hold: pass tokens=[...] ({geo_layers * heads} counts)")
    tok = np.asarray(counts, dtype=np.uint32)
    out._keep.append(tok)
    st.tokens = tok.ctypes.data_as(_lib.c_uint32_p)
    for (name, _kind), rows in zip(KINDS, rows_of):
        if rows is None:
            continue
        ptrs = (_lib.c_float_p * len(rows))(*[r.ctypes.data_as(_lib.c_float_p) for r in rows])
        out._keep.extend(rows)
        out._keep.append(ptrs)
        setattr(st, name, ctypes.cast(ptrs, ctypes.POINTER(_lib.c_float_p)))
    return out


class StepRows:
    """A step's rows in the session's ring (kvs_step_in_ring): for each
    array asked for, a list of 1-D float32 arrays in kvs_step's row order,
    views of the ring that the worker fills (`rows.score[l][:] = ...`,
    `torch.from_numpy(row).copy_(t)`) and passes to Sequence.step, which
    then copies nothing. They hold what is written until the session's
    next call (the step); they must not be used after the session ends."""

    __slots__ = ("score", "last_attn", "window_attn", "vnorm", "tokens", "_session")

    def __init__(self, session, tokens: np.ndarray) -> None:
        self._session = session  # the ring the views point into
        self.tokens = tokens
        self.score = self.last_attn = self.window_attn = self.vnorm = None


def rows_in_ring(session, c_rows, geo_layers: int, q_heads: int, kv_heads: int, heads: int,
                 tok: np.ndarray) -> StepRows:
    """The views of a filled kvs_step_rows (c_rows) over lists holding tok."""
    out = StepRows(session, tok)
    per_layer = {"1": 1, "q": q_heads, "kv": kv_heads}
    for name, kind in KINDS:
        table = getattr(c_rows, name)
        if not table:
            continue
        n_rows = per_layer[kind]
        views = []
        for i in range(geo_layers * n_rows):
            layer, r = divmod(i, n_rows)
            n = int(tok[layer * heads + _row_list(kind, r, heads, q_heads, kv_heads)])
            views.append(np.ctypeslib.as_array(table[i], shape=(n,)) if n else
                         np.empty(0, np.float32))
        setattr(out, name, views)
    return out


def _tokens_array(tokens: Seq[int], n: int) -> np.ndarray:
    tok = np.asarray(tokens)
    if tok.ndim != 1 or tok.shape[0] != n:
        raise InvalidArgument(f"step: tokens has shape {tok.shape}; expected {n} counts "
                              f"(layers x lists per layer)")
    if tok.size and (tok.min() < 0 or tok.max() > 0xFFFFFFFF):
        raise InvalidArgument("step: tokens must be uint32 counts")
    return np.ascontiguousarray(tok, dtype=np.uint32)


def u32(name: str, value: int) -> int:
    """value as a uint32, or InvalidArgument naming it."""
    if not isinstance(value, (int, np.integer)) or not 0 <= value <= 0xFFFFFFFF:
        raise InvalidArgument(f"step: {name}={value!r} is not a uint32")
    return int(value)
