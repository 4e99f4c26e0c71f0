"""kvstash - keep a worker's KV cache in kvstashd, from Python.

A pure-Python binding of libkvstash (client/kvstash.h) through ctypes:

    from kvstash import Session, Geometry
    with Session.attach("stories260K", Geometry(5, 8, 4, 8, 4)) as s:
        with s.create_sequence("full") as seq:
            t = seq.append(3)
            ...

Blocks of the pool are numpy views of the shared mapping (Session.block_keys):
what a worker writes there, every other worker of the pool sees. See the
top-level README, "Using kvstash from Python".
"""
import pkgutil

# The wire tests' generated stubs (kvstash.v1.store_pb2, in the build tree)
# live in another directory named kvstash: let them be found as subpackages.
__path__ = pkgutil.extend_path(__path__, __name__)

from .errors import (DataLoss, FailedPrecondition, InvalidArgument, KvstashError,  # noqa: E402
                     NotFound, PermissionDenied, ProtocolError, ResourceExhausted, SystemError_,
                     Unavailable, Unsupported)
from .events import Event, Events, events  # noqa: E402
from .geometry import Geometry  # noqa: E402
from .sequence import Revive, Sequence  # noqa: E402
from .session import Session, default_socket  # noqa: E402
from .stats import stats  # noqa: E402
from .table import (NO_BLOCK, TIER_FULL, TIER_INT2, TIER_INT4, TIER_INT8,  # noqa: E402
                    TIER_SKETCH, LayerList, StepResult, Table)

__version__ = "0.1.0"

__all__ = [
    "Session", "Sequence", "Revive", "Geometry", "Table", "LayerList", "StepResult", "Event",
    "Events", "events", "stats", "default_socket", "TIER_FULL", "TIER_INT8", "TIER_INT4",
    "TIER_INT2", "TIER_SKETCH",
    "NO_BLOCK", "KvstashError", "InvalidArgument", "NotFound", "PermissionDenied",
    "FailedPrecondition", "ResourceExhausted", "Unavailable", "ProtocolError", "SystemError_",
    "DataLoss", "Unsupported",
]
