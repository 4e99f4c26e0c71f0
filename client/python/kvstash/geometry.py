"""geometry.py - a model's KV geometry, and the pool dtypes as numpy sees them.

The daemon keys pools on (tenant, model, geometry): a worker states the
geometry it computes with, and attach fails (FailedPrecondition) when the
model's pool was made with another.
"""
from dataclasses import dataclass
from typing import Dict

import numpy as np

from . import _lib
from .errors import InvalidArgument

# kvs_dtype values by name, and the numpy dtype of a pool element (bf16 has
# none in numpy: its elements are seen as uint16 bit patterns).
DTYPE_CODES: Dict[str, int] = {"fp16": 1, "bf16": 2, "fp32": 3}
DTYPE_NAMES: Dict[int, str] = {v: k for k, v in DTYPE_CODES.items()}
NUMPY_DTYPES: Dict[str, np.dtype] = {"fp16": np.dtype(np.float16), "bf16": np.dtype(np.uint16),
                                     "fp32": np.dtype(np.float32)}


@dataclass(frozen=True)
class Geometry:
    """The shape of a model's KV cache: kvs_geometry. rope_theta 0 means
    10000 (the daemon fills it in: Session.geometry shows the pool's)."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "fp32"
    rope_theta: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise InvalidArgument(f"Geometry: dtype {self.dtype!r} is not one of "
                                  f"{sorted(DTYPE_CODES)}")

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of one pool element (uint16 for bf16)."""
        return NUMPY_DTYPES[self.dtype]

    def to_c(self) -> _lib.Geometry_:
        """The kvs_geometry; the daemon, not Python, judges the values (so a
        negative or huge one raises the daemon's InvalidArgument)."""
        fields = (self.layers, self.q_heads, self.kv_heads, self.head_dim, self.block_tokens)
        for name, value in zip(("layers", "q_heads", "kv_heads", "head_dim", "block_tokens"),
                               fields):
            if not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
                raise InvalidArgument(f"Geometry: {name}={value!r} is not a uint32")
        return _lib.Geometry_(*fields, DTYPE_CODES[self.dtype], float(self.rope_theta))

    @classmethod
    def from_c(cls, g: _lib.Geometry_) -> "Geometry":
        return cls(g.layers, g.q_heads, g.kv_heads, g.head_dim, g.block_tokens,
                   DTYPE_NAMES.get(g.dtype, "fp32"), float(g.rope_theta))
