"""session.py - a worker's attachment to one model's pool (kvs_session).

Attach maps the pool into this process; the pool's blocks are then numpy
views of that mapping (block_keys, block_values, block_raw, pool_array):
writing through a view writes the shared pool itself, which every other
worker of the pool (C or Python) sees at once, with no call and no copy.

The views are valid while the session is attached: detach unmaps the pool,
and touching a view afterwards is a segfault, as it is for a C worker that
keeps a pointer. A session is not thread-safe (as kvs_session): use one per
thread, or lock around it.
"""
import ctypes
import os
import weakref
from typing import TYPE_CHECKING, Dict, Optional

import numpy as np

from . import _lib
from .device import DeviceBuffer, stream_handle
from .errors import KVS_ERR_INVALID, InvalidArgument, Unsupported, end_with_block, error_for
from .geometry import Geometry

if TYPE_CHECKING:  # sequence.py imports this module
    from .sequence import Sequence


def default_socket() -> str:
    """The daemon's socket when none is given: $KVSTASH_SOCKET, else
    kvs_default_socket() ($XDG_RUNTIME_DIR/kvstash/kvstashd.sock or
    /run/kvstash/kvstashd.sock)."""
    env = os.environ.get("KVSTASH_SOCKET")
    if env:
        return env
    return _lib.lib().kvs_default_socket().decode()


def _detach(lib: ctypes.CDLL, handle: ctypes.c_void_p, owner_pid: int) -> int:
    """Detach a handle once (weakref.finalize: on detach(), on garbage and at
    exit). Not in a forked child: its copy of the session would end the
    parent's (client/kvstash.h: do not use a session across fork)."""
    if os.getpid() != owner_pid:
        return 0
    return lib.kvs_session_detach(handle)


class Session:
    """An attached worker. Use Session.attach(...) (a context manager whose
    exit detaches), then create_sequence.

    id, pool_id: the daemon's ids (as Stats shows them); geometry: the
    pool's (defaults filled in); block_count, block_bytes, pool_bytes: the
    mapped pool's shape; backend: "host", "cuda" (GPU memory imported by
    CUDA IPC: no numpy views, but torch views through pool_tensor; device is
    its CUDA ordinal here) or "shadow" (a test backend whose memory only
    libkvstash's copies may touch: no views at all).
    """

    def __init__(self, handle: ctypes.c_void_p, socket: str):
        lib = _lib.lib()
        self._lib = lib
        self._finalizer = weakref.finalize(self, _detach, lib, handle, os.getpid())
        self._live: Optional[ctypes.c_void_p] = handle  # None once detached
        self.socket = socket
        self.id: int = lib.kvs_session_id(handle)
        self.pool_id: int = lib.kvs_session_pool_id(handle)
        self.geometry: Geometry = Geometry.from_c(lib.kvs_session_geometry(handle).contents)
        self.block_count: int = lib.kvs_session_block_count(handle)
        self.block_bytes: int = lib.kvs_session_block_bytes(handle)
        self.pool_bytes: int = lib.kvs_session_pool_bytes(handle)
        self.backend: str = lib.kvs_session_backend(handle).decode()
        self.device: int = lib.kvs_session_device(handle)  # -1: host memory
        self._dtype = self.geometry.numpy_dtype
        self._block_shape = (self.geometry.kv_heads, self.geometry.block_tokens,
                             self.geometry.head_dim)
        self._pool: Optional[np.ndarray] = None
        if self.backend == "host":
            base = lib.kvs_session_pool(handle)
            buf = (ctypes.c_uint8 * self.pool_bytes).from_address(base)
            self._pool = np.frombuffer(buf, dtype=np.uint8)

    # ---- attach, detach ----

    @classmethod
    def attach(cls, model: str, geometry: Geometry, socket: Optional[str] = None,
               tenant: Optional[str] = None, worker_name: str = "py-worker") -> "Session":
        """kvs_session_attach_tenant: connect, attach to `model`'s pool of
        `tenant` (None: $KVSTASH_TENANT, else the default tenant), map it.
        socket None: $KVSTASH_SOCKET, else the library's default.

        Raises Unavailable (no daemon), FailedPrecondition (the model's pool
        has another geometry), InvalidArgument (a bad geometry or tenant)."""
        lib = _lib.lib()
        sock = socket or default_socket()
        geo = geometry.to_c()
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(1024)
        rc = lib.kvs_session_attach_tenant(sock.encode(), _opt(tenant), model.encode(),
                                           ctypes.byref(geo), worker_name.encode(),
                                           ctypes.byref(handle), err, len(err))
        if rc != 0:
            raise error_for(rc, err.value.decode("utf-8", "replace") or
                            lib.kvs_strerror(rc).decode())
        return cls(handle, sock)

    @property
    def attached(self) -> bool:
        return self._finalizer.alive

    def detach(self) -> None:
        """Release every sequence, end the lease and unmap the pool (the
        numpy views of it become invalid). Idempotent. Raises the Detach
        call's error, though the session is gone either way."""
        if not self._finalizer.alive:
            return
        self._pool = None
        self._live = None
        rc = self._finalizer()
        if rc:  # the session's message went with it: kvs_session_detach freed it
            raise error_for(rc, f"Detach of session {self.id}: "
                                f"{self._lib.kvs_strerror(rc).decode()} (the daemon reclaims "
                                f"the session anyway when its lease ends)")

    close = detach

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        end_with_block(self.detach, exc_type is not None)

    def handle(self) -> ctypes.c_void_p:
        """The kvs_session * (for calling libkvstash directly); raises
        InvalidArgument once detached."""
        h = self._live
        if h is None:
            raise InvalidArgument(f"session {self.id} is detached", KVS_ERR_INVALID)
        return h

    def error_message(self) -> str:
        """kvs_session_error: the daemon's message for the last failed call."""
        return self._lib.kvs_session_error(self.handle()).decode("utf-8", "replace")

    def raise_for(self, rc: int) -> None:
        """Raise the exception of kvs_err `rc` with the session's message."""
        raise error_for(rc, self.error_message() or self._lib.kvs_strerror(rc).decode())

    # ---- sequences ----

    def create_sequence(self, policy: str = "full", params: Optional[Dict[str, object]] = None,
                        label: str = "") -> "Sequence":
        """kvs_seq_create: a new sequence under `policy` with string
        parameters (values are converted with str()). The Sequence is a
        context manager whose exit releases it."""
        from .sequence import Sequence
        items = list((params or {}).items())
        arr = (_lib.Param_ * max(1, len(items)))()
        keep = []
        for i, (k, v) in enumerate(items):
            kb, vb = str(k).encode(), str(v).encode()
            keep += [kb, vb]
            arr[i].key, arr[i].value = kb, vb
        seq_id = ctypes.c_uint64()
        rc = self._lib.kvs_seq_create(self.handle(), policy.encode(), arr, len(items),
                                      label.encode(), ctypes.byref(seq_id))
        if rc:
            self.raise_for(rc)
        return Sequence(self, seq_id.value, policy)

    def ping(self) -> None:
        """kvs_ring_ping: one empty round trip on the session's ring."""
        rc = self._lib.kvs_ring_ping(self.handle())
        if rc:
            self.raise_for(rc)

    # ---- views of the pool ----

    def pool_array(self) -> np.ndarray:
        """The whole mapped pool as a uint8 numpy array (no copy). Raises
        Unsupported when the pool is not host memory."""
        self.handle()
        if self._pool is None:
            raise Unsupported(f"the pool of session {self.id} is on the {self.backend!r} "
                              f"backend: it cannot be read directly, only through "
                              f"Sequence.read / Sequence.write")
        return self._pool

    def pool_device(self) -> DeviceBuffer:
        """A cuda pool's imported arena as a DeviceBuffer
        (__cuda_array_interface__: torch.as_tensor, CuPy and numba read it
        without a copy). Raises Unsupported on a pool in host memory."""
        handle = self.handle()
        if self.backend != "cuda":
            raise Unsupported(f"the pool of session {self.id} is on the {self.backend!r} "
                              f"backend, not in GPU memory: use pool_array")
        return DeviceBuffer(self._lib.kvs_session_pool(handle), self.pool_bytes, self.device,
                            owner=self)

    def pool_tensor(self):
        """The whole pool as a uint8 torch tensor, a view of it (no copy): a
        CPU tensor over the mapping on the host backend, a CUDA tensor over
        the imported arena on cuda. Valid while the session is attached."""
        import torch
        if self.backend == "cuda":
            return torch.as_tensor(self.pool_device(), device=torch.device("cuda", self.device))
        return torch.from_numpy(self.pool_array())

    def set_stream(self, stream) -> None:
        """kvs_session_set_stream: the CUDA stream (torch.cuda.Stream, a
        cupy stream, an int handle, or None to unregister) that libkvstash
        synchronises before every request to the daemon (the ordering
        contract of client/kvstash.h). FailedPrecondition on a pool that is
        not in GPU memory."""
        rc = self._lib.kvs_session_set_stream(self.handle(), stream_handle(stream))
        if rc:
            self.raise_for(rc)

    def block_raw(self, block: int) -> np.ndarray:
        """Block `block`'s bytes (K half, then V half) as uint8: the layout of
        an INT8 block (kernels/kernels.h) is read from here."""
        pool = self.pool_array()
        if not 0 <= block < self.block_count:
            raise InvalidArgument(f"block {block} is outside the pool "
                                  f"({self.block_count} blocks)")
        start = block * self.block_bytes
        return pool[start:start + self.block_bytes]

    def block_keys(self, block: int) -> np.ndarray:
        """The K half of `block`: [kv_heads][block_tokens][head_dim] of the
        pool's dtype (uint16 for bf16), a view of the pool. A per-head list's
        row r is [r // block_tokens][r % block_tokens]."""
        raw = self.block_raw(block)
        return raw[:self.block_bytes // 2].view(self._dtype).reshape(self._block_shape)

    def block_values(self, block: int) -> np.ndarray:
        """The V half of `block`, shaped as block_keys."""
        raw = self.block_raw(block)
        return raw[self.block_bytes // 2:].view(self._dtype).reshape(self._block_shape)

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return (f"Session(id={self.id}, pool_id={self.pool_id}, {state}, "
                f"geometry={self.geometry})")


def _opt(text: Optional[str]) -> Optional[bytes]:
    return None if text is None else text.encode()
