"""kvio.py - K and V between a worker's arrays and a list's segments
(kvs_layer_write, kvs_layer_read).

The worker's side is contiguous, [kv_heads][tokens][head_dim] (or
[tokens][head_dim] for a per-head list) of the pool's dtype; libkvstash
does the strided copies through the pool backend's ops, so these work on
every backend (numpy views of blocks only on host memory). libkvstash gives
these two calls no message: the binding words one from the list.
"""
import ctypes
from typing import Optional, Tuple

import numpy as np

from .errors import KVS_ERR_PRECONDITION, InvalidArgument, error_for
from .session import Session
from .table import TIER_SKETCH, LayerList


def kv_shape(session: Session, lst: LayerList) -> Tuple[int, ...]:
    """The shape of one side (K or V) of `lst` in a worker's memory."""
    g = session.geometry
    return (lst.tokens, g.head_dim) if lst.per_head else (g.kv_heads, lst.tokens, g.head_dim)


def _as_kv(session: Session, name: str, arr, lst: LayerList) -> np.ndarray:
    """arr as a C-contiguous array of the pool's dtype and the list's shape
    (a torch CPU tensor is accepted: numpy reads it without a copy)."""
    want = kv_shape(session, lst)
    dt = session.geometry.numpy_dtype
    a = np.asarray(arr)
    if a.shape != want:
        raise InvalidArgument(f"write: {name} has shape {a.shape}; layer {lst.layer} head "
                              f"{lst.head} needs {want}")
    if a.dtype != dt:
        raise InvalidArgument(f"write: {name} is {a.dtype}; the pool holds {dt} "
                              f"({session.geometry.dtype})")
    return np.ascontiguousarray(a)


def _io_error(rc: int, verb: str, session: Session, lst: LayerList) -> Exception:
    where = f"{verb}: layer {lst.layer} head {lst.head}"
    if rc != KVS_ERR_PRECONDITION:
        return error_for(rc, f"{where}: the {session.backend} backend failed")
    tiers = lst.segments["tier"]
    counts = lst.segments["count"]
    if verb == "write":
        n = int(counts[tiers != 0].sum())
        return error_for(rc, f"{where}: {n} tokens are in INT8 or sketch segments; only "
                             f"full-precision segments (an append's) take writes")
    n = int(counts[tiers == TIER_SKETCH].sum())
    return error_for(rc, f"{where}: {n} tokens are held only in the sketch: read them "
                         f"through Sequence.revive")


def write(session: Session, lst: LayerList, k, v) -> None:
    """Copy k and v into the list's segments (kvs_layer_write)."""
    k_arr = _as_kv(session, "k", k, lst)
    v_arr = _as_kv(session, "v", v, lst)
    if lst.tokens == 0:
        return
    rc = session._lib.kvs_layer_write(session.handle(), ctypes.byref(lst._c), k_arr.ctypes.data,
                                      v_arr.ctypes.data)
    if rc:
        raise _io_error(rc, "write", session, lst)


def read(session: Session, lst: LayerList,
         out: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The list's K and V (kvs_layer_read: INT8 segments dequantised; sketch
    segments raise FailedPrecondition). `out`: two arrays to fill instead of
    new ones."""
    shape = kv_shape(session, lst)
    dt = session.geometry.numpy_dtype
    if out is None:
        k, v = np.empty(shape, dtype=dt), np.empty(shape, dtype=dt)
    else:
        k, v = out
        for name, a in (("k", k), ("v", v)):
            if a.shape != shape or a.dtype != dt or not a.flags.c_contiguous:
                raise InvalidArgument(f"read: out {name} must be C-contiguous {dt} {shape}, "
                                      f"not {a.dtype} {a.shape}")
    if lst.tokens == 0:
        return k, v
    rc = session._lib.kvs_layer_read(session.handle(), ctypes.byref(lst._c), k.ctypes.data,
                                     v.ctypes.data)
    if rc:
        raise _io_error(rc, "read", session, lst)
    return k, v
