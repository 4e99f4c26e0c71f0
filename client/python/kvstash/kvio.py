"""kvio.py - K and V between a worker's arrays and a list's segments
(kvs_layer_write, kvs_layer_read).

The worker's side is contiguous, [kv_heads][tokens][head_dim] (or
[tokens][head_dim] for a per-head list) of the pool's dtype; libkvstash
does the strided copies through the pool backend's ops, so these work on
every backend (numpy views of blocks only on host memory). On a cuda pool,
torch CUDA tensors on the pool's GPU are copied device to device
(kvs_layer_write_dev / kvs_layer_read_dev); numpy arrays and CPU tensors go
through host memory everywhere. libkvstash gives these calls no message:
the binding words one from the list.
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


_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _is_cuda(arr) -> bool:
    return bool(getattr(arr, "is_cuda", False))


def _check_cuda(session: Session, verb: str, name: str, t, lst: LayerList) -> None:
    """t (a torch CUDA tensor) is C-contiguous, of the list's shape and the
    pool's dtype, on the pool's GPU."""
    want = kv_shape(session, lst)
    dt = _TORCH_DTYPES[session.geometry.dtype]
    if session.backend != "cuda":
        raise InvalidArgument(f"{verb}: {name} is a CUDA tensor, but the pool is on the "
                              f"{session.backend!r} backend (host memory): pass a CPU array")
    if tuple(t.shape) != want or str(t.dtype) != f"torch.{dt}" or not t.is_contiguous():
        raise InvalidArgument(f"{verb}: {name} must be a contiguous torch.{dt} {want} tensor, "
                              f"not {t.dtype} {tuple(t.shape)}")
    if t.device.index != session.device:
        raise InvalidArgument(f"{verb}: {name} is on {t.device}; the pool is on "
                              f"cuda:{session.device}")


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
    """Copy k and v into the list's segments (kvs_layer_write; for torch
    CUDA tensors on a cuda pool, kvs_layer_write_dev)."""
    if _is_cuda(k) or _is_cuda(v):
        for name, t in (("k", k), ("v", v)):
            _check_cuda(session, "write", name, t, lst)
        if lst.tokens == 0:
            return
        rc = session._lib.kvs_layer_write_dev(session.handle(), ctypes.byref(lst._c),
                                              k.data_ptr(), v.data_ptr())
        if rc:
            raise _io_error(rc, "write", session, lst)
        return
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
    new ones; two torch CUDA tensors on a cuda pool are filled device to
    device (kvs_layer_read_dev)."""
    if out is not None and (_is_cuda(out[0]) or _is_cuda(out[1])):
        for name, t in zip("kv", out):
            _check_cuda(session, "read", name, t, lst)
        if lst.tokens:
            rc = session._lib.kvs_layer_read_dev(session.handle(), ctypes.byref(lst._c),
                                                 out[0].data_ptr(), out[1].data_ptr())
            if rc:
                raise _io_error(rc, "read", session, lst)
        return out
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
