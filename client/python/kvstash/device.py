"""device.py - a cuda pool's memory for CUDA libraries, without a copy.

On a pool of kvstashd's `cuda` backend, libkvstash imports the daemon's GPU
arena (CUDA IPC) and Session.pool_device() describes it with the CUDA Array
Interface (version 3, numba's protocol, which torch.as_tensor, CuPy and
numba read), so a worker's tensors are views of the pool itself:

    raw = torch.as_tensor(session.pool_device(), device=f"cuda:{session.device}")

Session.pool_tensor() does exactly that. The ordering contract of
client/kvstash.h holds for such views: before any request to the daemon,
the kernels that touched the pool have finished (register the stream they
run on with Session.set_stream, and libkvstash waits for it).
"""
from typing import Any, Dict, Optional


class DeviceBuffer:
    """`nbytes` bytes of device memory at `ptr` on CUDA device `device`, as
    a 1-D uint8 array (__cuda_array_interface__). `owner` is kept alive with
    it (the session whose import the memory is)."""

    def __init__(self, ptr: int, nbytes: int, device: int, owner: Any = None):
        self.ptr, self.nbytes, self.device, self.owner = ptr, nbytes, device, owner

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        # stream None: nothing to wait for (libkvstash's copies into the
        # pool completed before they returned).
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": None}

    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, device={self.device})"


def stream_handle(stream: Any) -> Optional[int]:
    """The cudaStream_t of `stream`: None, an int handle, or an object with a
    `cuda_stream` attribute (torch.cuda.Stream, cupy.cuda.Stream)."""
    if stream is None:
        return None
    handle = getattr(stream, "cuda_stream", stream)
    if not isinstance(handle, int) or isinstance(handle, bool):
        raise TypeError(f"a CUDA stream is None, an int handle or has .cuda_stream; "
                        f"got {type(stream).__name__}")
    return handle or None
