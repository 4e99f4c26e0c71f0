"""stats.py - the daemon's statistics (kvs_stats_json) as a dict.

Needs no session: a monitor or a test asks any daemon. The dict is the
StatsResponse of proto/kvstash/v1/store.proto in protobuf's JSON mapping
(camelCase keys are not used: libkvstash's pbjson writes the field names),
with every sequence's tokens and bytes per storage tier.

Where pools live (issue 14; docs/protocol.md, "Stats"): "backend" ("host",
"shadow", "cuda"), "device" ("none", or the GPU's UUID "GPU-..."),
"device_name" ("" or the GPU's name) and "ipc" ("memfd", "vmm", "legacy", or
"auto (unresolved)" before a cuda daemon's first pool). The lease-end
quarantine (docs/reliability.md, "Lease end"): "lease_end" ("free" or
"quarantine"), "quarantined_sessions", "quarantined_blocks", and each pool's
"blocks_quarantined".
"""
import ctypes
import json
from typing import Any, Dict, Optional

from . import _lib
from .errors import error_for
from .session import default_socket


def stats(socket: Optional[str] = None) -> Dict[str, Any]:
    """StatsResponse as a dict: backend, device, ipc, pools, sessions,
    sequences, tiers, policies, quarantine...
    Raises Unavailable when no daemon answers at the socket."""
    lib = _lib.lib()
    sock = socket or default_socket()
    out = ctypes.c_void_p()
    err = ctypes.create_string_buffer(1024)
    rc = lib.kvs_stats_json(sock.encode(), ctypes.byref(out), err, len(err))
    if rc:
        raise error_for(rc, err.value.decode("utf-8", "replace") or
                        lib.kvs_strerror(rc).decode())
    try:
        return json.loads(ctypes.string_at(out.value).decode("utf-8"))
    finally:
        _lib.libc_free(out)
