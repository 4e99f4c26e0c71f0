"""policies.py - what the worker must know about kvstashd's policies: which
statistics each asks for, whether it keeps one list per layer or one per KV
head, how --budget maps to its parameters, and the next-token confidence.

These mirror the registry (policies/*.c: each policy_ops' .needs, or its
.needs_alt where it has one, and .per_head) and kvstash-llama (client/llama/main.c map_budget, cache.c
resolve_params), so that the two workers send the same step for the same
settings. The daemon stays the judge of the parameters' values: a bad one
fails CreateSequence with its message.
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

# POLICY_NEEDS_* (policies/policy.h) = the STEP_* bits of proto/kvstash_step.h.
NEEDS_SCORE = 1 << 0
NEEDS_LAST_ATTN = 1 << 1
NEEDS_WINDOW_ATTN = 1 << 2
NEEDS_VNORM = 1 << 3
NEEDS_CONFIDENCE = 1 << 4

# name -> (needs, per_head): the .needs (.needs_alt where set: what a step
# sends) and .per_head of each policy_ops.
POLICIES: Dict[str, Tuple[int, bool]] = {
    "full": (0, False),
    "streaming": (0, False),
    "h2o": (NEEDS_SCORE, False),
    "tova": (NEEDS_SCORE, False),  # needs_alt: last_attn summed over the query heads
    "ov_block": (NEEDS_SCORE, False),
    "reviver": (NEEDS_SCORE, False),
    "confkv": (NEEDS_LAST_ATTN | NEEDS_CONFIDENCE, False),
    "snapkv": (NEEDS_WINDOW_ATTN, True),
    "adakv": (NEEDS_WINDOW_ATTN, True),
    "criticalkv": (NEEDS_WINDOW_ATTN | NEEDS_VNORM, True),
    "criticalkv_ada": (NEEDS_WINDOW_ATTN | NEEDS_VNORM, True),
    "weightedkv": (NEEDS_LAST_ATTN, True),
}

# Policies with a sketch of their own (policy_ops.sketch_geometry): their
# sequences hold sketch cells, which the table does not show.
OWN_SKETCH = ("reviver",)

SNAPKV_WINDOW_DEFAULT = 64  # SNAPKV_PARAM_WINDOW (policies/snapkv_family.h)
INT8_WINDOW = "8"  # --demote T: all but the newest 8 tokens of each list in tier T


class PolicyError(ValueError):
    """A policy or parameter the worker cannot run with (exit status 2)."""


@dataclass
class Policy:
    """A policy as the worker runs it: name, parameters in order (sent with
    every sequence), needs and per_head, the observation window of the
    SnapKV family, and confkv's confidence weights."""

    name: str
    params: List[Tuple[str, str]]
    needs: int
    per_head: bool
    window: int
    weights: "ConfidenceWeights"

    def param(self, key: str) -> str:
        for k, v in self.params:
            if k == key:
                return v
        return ""

    def holds_beyond_table(self) -> bool:
        """Whether its sequences can hold bytes the table does not show:
        sketch cells and offloaded victims (cache.c holds_beyond_table)."""
        return self.name in OWN_SKETCH or self.param("victims") not in ("", "evict")


@dataclass(frozen=True)
class ConfidenceWeights:
    """confkv's w_entropy, w_margin, w_top and margin_mode (POLICIES.md §5.2)."""

    entropy: float = 0.4
    margin: float = 0.3
    top: float = 0.3
    tanh: bool = False


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def budget_params(policy: str, budget: int, block_tokens: int) -> List[Tuple[str, str]]:
    """--budget N (tokens per layer; per KV head on average for per-head
    policies) as the policy's own parameters: main.c's map_budget."""
    N, B = budget, block_tokens
    if policy == "full":
        raise PolicyError("--budget: policy full keeps every token")
    if N < 8:
        raise PolicyError("--budget must be at least 8 tokens")
    if policy == "streaming":
        return [("n_sink", "4"), ("window", str(N - 4))]
    if policy in ("h2o", "tova", "reviver"):
        return [("budget", str(N))]
    if policy in ("snapkv", "adakv", "criticalkv", "criticalkv_ada"):
        return [("budget", str(N)), ("window", str(min(N // 4, 32)))]
    if policy == "ov_block":
        start, recent = _round_up(4, B), _round_up(max(N // 4, B), B)
        top = _round_up(N, B)
        if top <= start + recent:
            raise PolicyError(f"--budget {N} is too small for ov_block with {B}-token blocks")
        return [("start_size", str(start)), ("recent_size", str(recent)),
                ("max_cache_size", str(top))]
    if policy == "confkv":
        return [("budget_tight", str(N)), ("budget_loose", str(2 * N)),
                ("protect", str(N // 4)), ("fp16_window", str(N // 2))]
    if policy == "weightedkv":
        return [("cache_size", str(N)), ("n_init", "4"), ("n_recent", str(N // 2 - 4))]
    raise PolicyError(f"--budget: no mapping for policy {policy}; use --set")


def resolve(name: str, sets: List[Tuple[str, str]], budget: int, demote: str,
            block_tokens: int, context: int) -> Policy:
    """The parameters kvstash-llama would send: --set first (they win), then
    the --budget mapping's keys not set, then demote=T, int8_window=8 unless
    demote is "off"."""
    if name not in POLICIES:
        raise PolicyError(f"unknown policy '{name}' (kvstash policy list)")
    needs, per_head = POLICIES[name]
    params = list(sets)
    keys = {k for k, _ in params}
    extra = budget_params(name, budget, block_tokens) if budget else []
    if demote != "off":
        extra += [("demote", demote), ("int8_window", INT8_WINDOW)]
    for k, v in extra:
        if k not in keys:
            params.append((k, v))
            keys.add(k)
    # demote_keep grades precision by attention (policies/storage.h): the
    # steps carry it even for a policy that needs none, as kvstash-llama's do.
    keep = next((v for k, v in params if k == "demote_keep"), "0")
    try:
        graded = float(keep) > 0
    except ValueError:
        graded = False  # kvstashd names the bad value
    if graded:
        needs |= NEEDS_LAST_ATTN if per_head else NEEDS_SCORE
    p = Policy(name, params, needs, per_head, 1, ConfidenceWeights())
    if needs & NEEDS_WINDOW_ATTN:
        raw = p.param("window") or str(SNAPKV_WINDOW_DEFAULT)
        try:
            window = int(raw)
        except ValueError:
            raise PolicyError(f"parameter window must be an integer, got '{raw}'") from None
        if not 1 <= window <= 1 << 20:
            raise PolicyError(f"parameter window must be in 1..1048576, got {window}")
        p.window = min(window, context)
    if needs & NEEDS_CONFIDENCE:
        p.weights = _weights(p)
    return p


def _weights(p: Policy) -> ConfidenceWeights:
    d = ConfidenceWeights()
    try:
        w = ConfidenceWeights(float(p.param("w_entropy") or d.entropy),
                              float(p.param("w_margin") or d.margin),
                              float(p.param("w_top") or d.top),
                              (p.param("margin_mode") or "sigmoid") == "tanh")
    except ValueError as e:
        raise PolicyError(f"confkv weights: {e}") from None
    if abs(w.entropy + w.margin + w.top - 1.0) > 1e-6:
        raise PolicyError("parameters w_entropy + w_margin + w_top must sum to 1, got "
                          f"{w.entropy + w.margin + w.top:g}")
    return w


def confidence(logits: np.ndarray, w: ConfidenceWeights) -> float:
    """confkv_confidence_logits (policies/confkv.c): c = wH (1 - H~) +
    wM sigma(D) + wP p1 from the logits in double, log space; -1 (no
    confidence) when a logit is not finite or there are fewer than 2."""
    z = logits.astype(np.float64)
    V = z.shape[0]
    if V < 2 or not np.isfinite(z).all():
        return -1.0
    top2 = np.partition(z, V - 2)[V - 2:]
    z1, z2 = float(top2.max()), float(top2.min())
    lse = z1 + math.log(float(np.exp(z - z1).sum()))
    lp = z - lse
    entropy = float(-(np.exp(lp) * lp).sum())
    ht = min(max(entropy / math.log(V), 0.0), 1.0)
    s = 1.0 / (1.0 + math.exp(-(z1 - z2)))
    margin = 2.0 * s - 1.0 if w.tanh else s
    c = w.entropy * (1.0 - ht) + w.margin * margin + w.top * math.exp(z1 - lse)
    c = min(max(c, 0.0), 1.0)
    return c if 0.0 <= c <= 1.0 else -1.0
