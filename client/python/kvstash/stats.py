"""stats.py - the daemon's statistics (kvs_stats_json) as a dict.

Needs no session: a monitor or a test asks any daemon. The dict is the
StatsResponse of proto/kvstash/v1/store.proto in protobuf's JSON mapping
(camelCase keys are not used: libkvstash's pbjson writes the field names),
with every sequence's tokens and bytes per storage tier.
"""
import ctypes
import json
from typing import Any, Dict, Optional

from . import _lib
from .errors import error_for
from .session import default_socket


def stats(socket: Optional[str] = None) -> Dict[str, Any]:
    """StatsResponse as a dict: pools, sessions, sequences, tiers, policies...
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
