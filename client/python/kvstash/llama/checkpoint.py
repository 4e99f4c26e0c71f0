"""checkpoint.py - a llama2.c checkpoint as torch tensors.

The format is the one client/llama/model.h describes (and kvstash-llama
reads): 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size -- negative means an unshared classifier at the end
--, seq_len), then fp32 arrays: token embedding, rms_att, wq, wk, wv, wo,
rms_ffn, w1, w2, w3, rms_final, two legacy RoPE tables of
seq_len * head_size / 2 floats each (skipped), then wcls if unshared.

The file is mapped read-only (numpy.memmap) and the tensors are views of it,
so a 60 MB model costs no copy; the size must match the header exactly, as in
model.c, so a truncated download fails here and not in the middle of a run.
"""
import os
import warnings
from dataclasses import dataclass
from typing import Dict

import numpy as np
import torch

HEADER_BYTES = 28
MAX_FIELD = 1 << 20


class CheckpointError(ValueError):
    """The file is not a llama2.c checkpoint this worker can run."""


@dataclass(frozen=True)
class Config:
    """The header of a checkpoint, plus the two sizes derived from it."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size


def _config(header: np.ndarray, path: str) -> Config:
    """Check the header's numbers as model.c's config_check does."""
    h = [int(x) for x in header]
    for i, value in enumerate(h):
        if i != 5 and not 0 < value <= MAX_FIELD:
            raise CheckpointError(f"{path}: header field {i} is {value} (want 1..2^20)")
    if h[5] == 0 or not -MAX_FIELD <= h[5] <= MAX_FIELD:
        raise CheckpointError(f"{path}: vocab_size is {h[5]}")
    c = Config(h[0], h[1], h[2], h[3], h[4], abs(h[5]), h[6], h[5] > 0)
    if c.dim % c.n_heads or c.n_heads % c.n_kv_heads or (c.dim // c.n_heads) % 2:
        raise CheckpointError(
            f"{path}: dim {c.dim}, n_heads {c.n_heads}, n_kv_heads {c.n_kv_heads}: want dim = "
            "n_heads * an even head size and n_heads a multiple of n_kv_heads")
    return c


def _float_counts(c: Config) -> Dict[str, tuple]:
    """The arrays of the file in order, each with its shape (row-major
    [out][in] matrices, one per layer stacked first)."""
    D, H, L, V, K = c.dim, c.hidden_dim, c.n_layers, c.vocab_size, c.kv_dim
    shapes = {
        "token_embedding": (V, D),
        "rms_att": (L, D),
        "wq": (L, D, D),
        "wk": (L, K, D),
        "wv": (L, K, D),
        "wo": (L, D, D),
        "rms_ffn": (L, D),
        "w1": (L, H, D),
        "w2": (L, D, H),
        "w3": (L, H, D),
        "rms_final": (D,),
        "freq_cis": (c.seq_len * c.head_size,),  # two legacy RoPE tables, unused
    }
    if not c.shared_classifier:
        shapes["wcls"] = (V, D)
    return shapes


class Checkpoint:
    """A mapped checkpoint: .config and the weights as fp32 torch tensors
    (views of the file; do not write to them)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
        if size < HEADER_BYTES:
            raise CheckpointError(f"{path}: not a llama2.c checkpoint (shorter than its header)")
        header = np.fromfile(path, dtype="<i4", count=7)
        self.config = _config(header, path)
        shapes = _float_counts(self.config)
        floats = sum(int(np.prod(s)) for s in shapes.values())
        if size != HEADER_BYTES + 4 * floats:
            raise CheckpointError(f"{path}: {size} bytes, but its header describes "
                                  f"{HEADER_BYTES + 4 * floats}")
        data = np.memmap(path, dtype="<f4", mode="r", offset=HEADER_BYTES, shape=(floats,))
        self.weights: Dict[str, torch.Tensor] = {}
        at = 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            arr = np.asarray(data[at:at + n]).reshape(shape)
            at += n
            if name == "freq_cis":
                continue
            self.weights[name] = _as_tensor(arr)
        if self.config.shared_classifier:
            self.weights["wcls"] = self.weights["token_embedding"]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[name]


def _as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A float32 tensor over a read-only numpy view without copying it (torch
    1.13 has no read-only tensors; the worker never writes weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
