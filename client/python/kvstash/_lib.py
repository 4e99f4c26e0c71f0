"""_lib.py - find and load libkvstash.so, and declare its C API for ctypes.

The structures mirror client/kvstash.h field for field; the prototypes give
ctypes the argument and result types so that 64-bit handles and sizes are
never truncated to C int. Nothing here talks to the daemon: the other
modules call lib().kvs_* and turn codes into exceptions (errors.py).

Where the library is looked for, in order (the first that loads wins):
$KVSTASH_LIB, beside the package (kvstash/libkvstash.so), the build tree
(<repo>/build/client/libkvstash.so), then the system's search path.
"""
import ctypes
import ctypes.util
import os
from typing import List

c_uint32_p = ctypes.POINTER(ctypes.c_uint32)
c_float_p = ctypes.POINTER(ctypes.c_float)


class Geometry_(ctypes.Structure):
    """kvs_geometry."""
    _fields_ = [("layers", ctypes.c_uint32), ("q_heads", ctypes.c_uint32),
                ("kv_heads", ctypes.c_uint32), ("head_dim", ctypes.c_uint32),
                ("block_tokens", ctypes.c_uint32), ("dtype", ctypes.c_int),
                ("rope_theta", ctypes.c_float)]


class Param_(ctypes.Structure):
    """kvs_param."""
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class Segment_(ctypes.Structure):
    """kvs_segment: four uint32 (block, first_slot, count, tier)."""
    _fields_ = [("block", ctypes.c_uint32), ("first_slot", ctypes.c_uint32),
                ("count", ctypes.c_uint32), ("tier", ctypes.c_uint32)]


class Layer_(ctypes.Structure):
    """kvs_layer: one token list of a table."""
    _fields_ = [("tokens", ctypes.c_uint32), ("nsegments", ctypes.c_size_t),
                ("segments", ctypes.POINTER(Segment_)), ("positions", c_uint32_p),
                ("layer", ctypes.c_uint32), ("per_head", ctypes.c_int),
                ("head", ctypes.c_uint32), ("int8_block_tokens", ctypes.c_uint32),
                ("int4_block_tokens", ctypes.c_uint32), ("int2_block_tokens", ctypes.c_uint32),
                ("quant_group", ctypes.c_uint32)]


class Table_(ctypes.Structure):
    """kvs_table: `layers` lists (layers x heads), owned by libkvstash until
    kvs_table_free."""
    _fields_ = [("epoch", ctypes.c_uint64), ("first_position", ctypes.c_uint32),
                ("evicted", ctypes.c_uint32), ("layers", ctypes.c_uint32),
                ("heads", ctypes.c_uint32), ("layer", ctypes.POINTER(Layer_)),
                ("room", ctypes.c_void_p)]


class MovedRun_(ctypes.Structure):
    """kvs_moved_run: tokens [first, first + at.count) of list `list` now at `at`."""
    _fields_ = [("list", ctypes.c_uint32), ("first", ctypes.c_uint32), ("at", Segment_)]


class Step_(ctypes.Structure):
    """kvs_step: a step's statistics, arrays as row-pointer tables."""
    _fields_ = [("new_tokens", ctypes.c_uint32), ("prefill", ctypes.c_int),
                ("heads", ctypes.c_uint32), ("tokens", c_uint32_p),
                ("score", ctypes.POINTER(c_float_p)), ("score_queries", ctypes.c_uint32),
                ("last_attn", ctypes.POINTER(c_float_p)),
                ("window_attn", ctypes.POINTER(c_float_p)),
                ("window_queries", ctypes.c_uint32), ("vnorm", ctypes.POINTER(c_float_p)),
                ("confidence", ctypes.c_double)]


class StepRows_(ctypes.Structure):
    """kvs_step_rows: row-pointer tables into the session's ring."""
    _fields_ = [("score", ctypes.POINTER(c_float_p)), ("last_attn", ctypes.POINTER(c_float_p)),
                ("window_attn", ctypes.POINTER(c_float_p)), ("vnorm", ctypes.POINTER(c_float_p))]


class StepResult_(ctypes.Structure):
    """kvs_step_result."""
    _fields_ = [("epoch", ctypes.c_uint64), ("evicted", ctypes.c_uint32),
                ("cut_epoch", ctypes.c_uint64), ("cut_lists", ctypes.c_uint32),
                ("cut_start", c_uint32_p), ("cut", c_uint32_p)]


class Revive_(ctypes.Structure):
    """kvs_revive: a revived list in scratch blocks until kvs_revive_release."""
    _fields_ = [("scratch_id", ctypes.c_uint64), ("table", Table_),
                ("layer", ctypes.POINTER(Layer_)), ("source_tier", ctypes.POINTER(ctypes.c_uint8)),
                ("from_full", ctypes.c_uint32), ("from_int8", ctypes.c_uint32),
                ("from_sketch", ctypes.c_uint32), ("epoch", ctypes.c_uint64)]


# kvs_seq_revive's flags (kvstash.h).
REVIVE_SKIP_EVICTED = 1
REVIVE_IN_PLACE = 2

_S = ctypes.c_void_p  # kvs_session *
_PROTOTYPES = {
    # name: (restype, argtypes)
    "kvs_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "kvs_default_socket": (ctypes.c_char_p, []),
    "kvs_session_attach_tenant": (ctypes.c_int, [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(Geometry_),
        ctypes.c_char_p, ctypes.POINTER(_S), ctypes.c_char_p, ctypes.c_size_t]),
    "kvs_session_detach": (ctypes.c_int, [_S]),
    "kvs_session_error": (ctypes.c_char_p, [_S]),
    "kvs_session_id": (ctypes.c_uint64, [_S]),
    "kvs_session_geometry": (ctypes.POINTER(Geometry_), [_S]),
    "kvs_session_pool": (ctypes.c_void_p, [_S]),
    "kvs_session_backend": (ctypes.c_char_p, [_S]),
    "kvs_session_device": (ctypes.c_int, [_S]),
    "kvs_session_set_stream": (ctypes.c_int, [_S, ctypes.c_void_p]),
    "kvs_session_pool_bytes": (ctypes.c_size_t, [_S]),
    "kvs_session_block_bytes": (ctypes.c_size_t, [_S]),
    "kvs_session_pool_id": (ctypes.c_uint64, [_S]),
    "kvs_session_block_count": (ctypes.c_uint32, [_S]),
    "kvs_seq_create": (ctypes.c_int, [_S, ctypes.c_char_p, ctypes.POINTER(Param_),
                                      ctypes.c_size_t, ctypes.c_char_p,
                                      ctypes.POINTER(ctypes.c_uint64)]),
    "kvs_seq_release": (ctypes.c_int, [_S, ctypes.c_uint64]),
    "kvs_table_free": (None, [ctypes.POINTER(Table_)]),
    "kvs_table_moves": (None, [ctypes.POINTER(Table_), ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.POINTER(MovedRun_)),
                               ctypes.POINTER(ctypes.c_size_t)]),
    "kvs_seq_append": (ctypes.c_int, [_S, ctypes.c_uint64, ctypes.c_int64,
                                      ctypes.POINTER(Table_)]),
    "kvs_seq_step": (ctypes.c_int, [_S, ctypes.c_uint64, ctypes.POINTER(Step_),
                                    ctypes.POINTER(StepResult_)]),
    "kvs_step_in_ring": (ctypes.c_int, [_S, ctypes.c_uint32, c_uint32_p, ctypes.c_uint,
                                        ctypes.POINTER(StepRows_)]),
    "kvs_seq_epoch": (ctypes.c_int, [_S, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]),
    "kvs_ring_ping": (ctypes.c_int, [_S]),
    "kvs_seq_table": (ctypes.c_int, [_S, ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(Table_)]),
    "kvs_row_key_ptr": (ctypes.c_void_p, [_S, ctypes.c_uint32, ctypes.c_uint32]),
    "kvs_row_value_ptr": (ctypes.c_void_p, [_S, ctypes.c_uint32, ctypes.c_uint32]),
    "kvs_key_ptr": (ctypes.c_void_p, [_S, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]),
    "kvs_value_ptr": (ctypes.c_void_p, [_S, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]),
    "kvs_layer_write": (ctypes.c_int, [_S, ctypes.POINTER(Layer_), ctypes.c_void_p,
                                       ctypes.c_void_p]),
    "kvs_layer_read": (ctypes.c_int, [_S, ctypes.POINTER(Layer_), ctypes.c_void_p,
                                      ctypes.c_void_p]),
    "kvs_layer_write_dev": (ctypes.c_int, [_S, ctypes.POINTER(Layer_), ctypes.c_void_p,
                                           ctypes.c_void_p]),
    "kvs_layer_read_dev": (ctypes.c_int, [_S, ctypes.POINTER(Layer_), ctypes.c_void_p,
                                          ctypes.c_void_p]),
    "kvs_seq_revive": (ctypes.c_int, [_S, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32,
                                      ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint,
                                      ctypes.POINTER(Revive_)]),
    "kvs_revive_release": (ctypes.c_int, [_S, ctypes.POINTER(Revive_)]),
    # char ** out-parameters are c_void_p so that the pointer can be freed.
    "kvs_stats_json": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.c_char_p, ctypes.c_size_t]),
    "kvs_events_open": (ctypes.c_int, [ctypes.c_char_p]),
    "kvs_events_next": (ctypes.c_int, [ctypes.c_int, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_void_p)]),
    "kvs_events_close": (None, [ctypes.c_int]),
}


def candidates() -> List[str]:
    """Where libkvstash.so is looked for, in order (see the module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.abspath(os.path.join(here, "..", "..", ".."))
    found = []
    if os.environ.get("KVSTASH_LIB"):
        found.append(os.environ["KVSTASH_LIB"])
    found.append(os.path.join(here, "libkvstash.so"))
    found.append(os.path.join(repo, "build", "client", "libkvstash.so"))
    found.append(ctypes.util.find_library("kvstash") or "libkvstash.so")
    return found


def load() -> ctypes.CDLL:
    """Load the first candidate that loads and declare every prototype.
    Raises OSError listing every place tried and why it failed."""
    tried = []
    for path in candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (no such file)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        lib.kvstash_path = path
        return lib
    raise OSError("kvstash: cannot load libkvstash.so; tried: " + "; ".join(tried) +
                  " (build it with cmake, or set KVSTASH_LIB to its path)")


# libc's free(), for the strings libkvstash returns malloc'd (kvs_stats_json,
# kvs_events_next).
_libc = ctypes.CDLL(None)
libc_free = _libc.free
libc_free.restype = None
libc_free.argtypes = [ctypes.c_void_p]

_loaded = None


def lib() -> ctypes.CDLL:
    """The loaded library, loaded on first use (so that `import kvstash` works,
    and names like Geometry can be used, on a machine without it)."""
    global _loaded
    if _loaded is None:
        _loaded = load()
    return _loaded
