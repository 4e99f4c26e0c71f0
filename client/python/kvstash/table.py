"""table.py - block tables as Python objects over libkvstash's kvs_table.

A Table owns the C kvs_table that an append, a table call or a revive
filled, and frees it when it is garbage (or, for a revive, leaves that to
kvs_revive_release). Its lists are built on first access: an append on the
per-step path only pays for what the worker looks at. A LayerList copies
its segments and positions into numpy arrays (a few dozen bytes) and keeps
the Table alive, so Sequence.write and Sequence.read can hand libkvstash
the C list itself.
"""
import ctypes
from typing import List, NamedTuple, Optional

import numpy as np

from . import _lib

TIER_FULL = 0    # slots of a pool block in the pool's dtype
TIER_INT8 = 1    # slots of the INT8 block held in pool block `block`
TIER_SKETCH = 2  # only in the daemon's sketch: Sequence.revive rebuilds it
TIER_INT4 = 4    # slots of the INT4 block held in pool block `block` (demote=int4)
TIER_INT2 = 5    # the same in 2 bits (demote=int2)
NO_BLOCK = 0xFFFFFFFF  # the block of a sketch segment

SEGMENT_DTYPE = np.dtype([("block", np.uint32), ("first_slot", np.uint32),
                          ("count", np.uint32), ("tier", np.uint32)])
assert SEGMENT_DTYPE.itemsize == ctypes.sizeof(_lib.Segment_)


class StepResult(NamedTuple):
    """kvs_step_result: the table epoch after the policy's decision, and the
    tokens it removed (all layers; 0: the table did not shrink).

    cuts: when removing tokens was all the step did to the table, one uint32
    array per list (the table's order): the indices of the tokens it lost,
    in the list as it was at cut_epoch, ascending. A worker that holds the
    table of cut_epoch deletes them and has the table of `epoch` without
    reading it; None: read the table (Sequence.table) if the epoch moved."""
    epoch: int
    evicted: int
    cut_epoch: int = 0
    cuts: Optional[List[np.ndarray]] = None

    @staticmethod
    def from_c(res: _lib.StepResult_) -> "StepResult":
        if res.cut_lists == 0:
            return StepResult(res.epoch, res.evicted)
        n = res.cut_lists
        start = np.ctypeslib.as_array(res.cut_start, shape=(n + 1,)).astype(np.int64)
        total = int(start[n])
        flat = (np.ctypeslib.as_array(res.cut, shape=(total,)).copy() if total
                else np.zeros(0, dtype=np.uint32))
        return StepResult(res.epoch, res.evicted, res.cut_epoch,
                          np.split(flat, start[1:n]))


class LayerList:
    """One token list of a table: a layer's (or, for per-head policies, one
    KV head's) segments, in token order.

    layer, head, per_head: which list; tokens: how many it holds (for an
    append, how many to write); int8_block_tokens, int4_block_tokens,
    int2_block_tokens: slots of an INT8, INT4, INT2 block; quant_group: the
    INT4 / INT2 groups' size;
    segments: structured array (block, first_slot, count, tier);
    positions: uint32 original positions, or None when not asked for.
    """

    __slots__ = ("layer", "head", "per_head", "tokens", "int8_block_tokens", "int4_block_tokens",
                 "int2_block_tokens", "quant_group", "segments", "positions", "_c", "_owner")

    def __init__(self, c_layer: _lib.Layer_, owner: "Table"):
        self._c = c_layer
        self._owner = owner  # keeps the C memory behind _c alive
        self.layer = c_layer.layer
        self.head = c_layer.head
        self.per_head = bool(c_layer.per_head)
        self.tokens = c_layer.tokens
        self.int8_block_tokens = c_layer.int8_block_tokens
        self.int4_block_tokens = c_layer.int4_block_tokens
        self.int2_block_tokens = c_layer.int2_block_tokens
        self.quant_group = c_layer.quant_group
        n = c_layer.nsegments
        if n:
            raw = ctypes.cast(c_layer.segments, ctypes.POINTER(_lib.Segment_ * n)).contents
            self.segments = np.frombuffer(raw, dtype=SEGMENT_DTYPE).copy()
        else:
            self.segments = np.zeros(0, dtype=SEGMENT_DTYPE)
        if c_layer.positions and c_layer.tokens:
            raw = ctypes.cast(c_layer.positions,
                              ctypes.POINTER(ctypes.c_uint32 * c_layer.tokens)).contents
            self.positions: Optional[np.ndarray] = np.frombuffer(raw, dtype=np.uint32).copy()
        elif c_layer.positions:
            self.positions = np.zeros(0, dtype=np.uint32)
        else:
            self.positions = None

    @property
    def tiers(self) -> np.ndarray:
        """The tier of each segment (TIER_FULL, TIER_INT8, TIER_INT4, TIER_INT2,
        TIER_SKETCH)."""
        return self.segments["tier"]

    def __repr__(self) -> str:
        return (f"LayerList(layer={self.layer}, head={self.head}, per_head={self.per_head}, "
                f"tokens={self.tokens}, segments={self.segments.tolist()})")


MOVED_RUN_DTYPE = np.dtype([("list", np.uint32), ("first", np.uint32), ("block", np.uint32),
                            ("first_slot", np.uint32), ("count", np.uint32), ("tier", np.uint32)])
assert MOVED_RUN_DTYPE.itemsize == ctypes.sizeof(_lib.MovedRun_)


class Moves(NamedTuple):
    """A demotion published before an append (kvs_table_moves): the runs of
    tokens it moved, which take a table of from_epoch to to_epoch (the
    append's writes then extend it). runs: structured array (list, first,
    block, first_slot, count, tier): tokens [first, first + count) of list
    `list` are now slots [first_slot, first_slot + count) of `block`, in
    `tier`; positions and order unchanged."""
    from_epoch: int
    to_epoch: int
    runs: np.ndarray


class Table:
    """A sequence's block tables at one epoch (kvs_table).

    epoch; first_position and evicted (appends: the position of the first new
    token, the tokens the policy removed); heads: lists per layer (1, or
    kv_heads for per-head policies); lists: every LayerList, entry i being
    layer i // heads, KV head i % heads.
    """

    __slots__ = ("_c", "_free", "_lists", "epoch", "first_position", "evicted", "heads",
                 "__weakref__")

    def __init__(self, c_table: _lib.Table_, free: bool = True):
        self._c = c_table
        self._free = free  # False: a revive's table, freed by kvs_revive_release
        self._lists: Optional[List[LayerList]] = None
        self.epoch = c_table.epoch
        self.first_position = c_table.first_position
        self.evicted = c_table.evicted
        self.heads = c_table.heads

    @property
    def lists(self) -> List[LayerList]:
        if self._lists is None:
            arr = self._c.layer
            self._lists = [LayerList(arr[i], self) for i in range(self._c.layers)]
        return self._lists

    def moves(self) -> Optional[Moves]:
        """An append's writes: the moves of a demotion published before the
        append, or None."""
        f, t, n = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
        runs = ctypes.POINTER(_lib.MovedRun_)()
        _lib.lib().kvs_table_moves(ctypes.byref(self._c), ctypes.byref(f), ctypes.byref(t),
                                   ctypes.byref(runs), ctypes.byref(n))
        if n.value == 0:
            return None
        raw = ctypes.string_at(runs, n.value * ctypes.sizeof(_lib.MovedRun_))
        return Moves(f.value, t.value, np.frombuffer(raw, dtype=MOVED_RUN_DTYPE).copy())

    def list(self, layer: int, head: int = 0) -> LayerList:
        """The list of `layer` (and KV head `head` for per-head tables)."""
        return self.lists[layer * self.heads + (head if self.heads > 1 else 0)]

    def __len__(self) -> int:
        return self._c.layers

    def __del__(self) -> None:
        try:
            if self._free and self._c.layer:
                _lib.lib().kvs_table_free(ctypes.byref(self._c))
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process frees it
            pass

    def __repr__(self) -> str:
        return (f"Table(epoch={self.epoch}, first_position={self.first_position}, "
                f"evicted={self.evicted}, heads={self.heads}, lists={len(self)})")
