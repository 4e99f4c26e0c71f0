#!/usr/bin/python3
"""policy_decision_torch.py - the PyTorch side of bench_policy_decision.

The same rules as policies/ (POLICIES.md §1.3-§1.5, §1.9, h2o.c, tova.c),
written as a PyTorch user would write them on the CPU: avg_pool1d, mean,
torch.topk. Run by bench_policy_decision with /usr/bin/python3 (Debian's
python3-torch), on the inputs it wrote; prints one line per policy and
thread count, "time POLICY THREADS MS" (median of --reps decisions; CPU
time of the thread on one thread, wall clock on more), and writes every policy's kept mask (uint8, [layers][lists][tokens],
lists = KV heads for the SnapKV family, 1 for h2o and tova) to --output.

Ties. torch.topk does not say which of equal values it returns, while the
policies break ties by the lower index (POLICIES.md "Common notation").
first_k() below takes torch.topk's k-th value as a threshold, keeps what is
above it and, of the values equal to it, the lowest indices (a cumsum),
so its set is the deterministic one; that costs a few elementwise passes,
timed with the rule. The inputs are integer multiples of powers of two, so
pooling, means and sums are exact in float64 on both sides (the pool's sum
is a multiple of 5·2^-24, divided by 5 exactly) and equal scores are really
equal. Forced entries (CriticalKV stage 1, the AdaKV safeguard) are +inf, as
the reference's dtype maximum, which orders them the same way here.
"""
import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

CR = 0.75  # compression_ratio the C side gives the SnapKV family: keep = tokens / 4


def first_k(x, k):
    """Mask of the k largest entries along the last dim; ties to the lower index."""
    n = x.shape[-1]
    if k <= 0:
        return torch.zeros_like(x, dtype=torch.bool)
    if k >= n:
        return torch.ones_like(x, dtype=torch.bool)
    thr = torch.topk(x, k, dim=-1, sorted=False).values.min(dim=-1, keepdim=True).values
    above = x > thr
    tie = x == thr
    need = k - above.sum(dim=-1, keepdim=True)
    return above | (tie & (torch.cumsum(tie, dim=-1) <= need))


def snapkv_scores(wa, a):
    """SnapKV base scores of one layer (§1.3): wa [Hq, L] float32 -> [Hkv, L] float64."""
    L = wa.shape[1]
    P = L - a.window
    w = wa[:, :P].double().unsqueeze(1)
    pooled = F.avg_pool1d(w, a.kernel, stride=1, padding=a.kernel // 2,
                          count_include_pad=True).squeeze(1)
    s = pooled.view(a.kv_heads, a.q_heads // a.kv_heads, P).mean(dim=1)
    out = torch.empty(a.kv_heads, L, dtype=torch.float64)
    out[:, :P] = s
    out[:, P:] = s.max() + 1  # kvpress: window tokens score max + 1
    return out


def snapkv(x, l, a):
    return first_k(snapkv_scores(x["window_attn"][l], a), a.keep)


def criticalkv(x, l, a, alpha=0.5, eps=1e-4):
    s = snapkv_scores(x["window_attn"][l], a)
    L = a.tokens
    b1 = int((1 - CR) * L * alpha)  # §1.4: from the product
    stage1 = first_k(s, b1)
    z = (s + eps) * x["vnorm"][l].double()
    z = torch.where(stage1, torch.full_like(z, float("inf")), z)
    return first_k(z, a.keep)


def adakv(x, l, a, alpha_safeguard=0.2):
    s = snapkv_scores(x["window_attn"][l], a)
    n_safe = int(a.keep * alpha_safeguard)
    forced = first_k(s, n_safe)
    s = torch.where(forced, torch.full_like(s, float("inf")), s)
    # AdaKVPress: evict topk(-scores) of the heads flattened, head-major.
    flat = s.reshape(-1)
    evict = first_k(-flat, flat.numel() - a.keep * a.kv_heads)
    return (~evict).view(a.kv_heads, a.tokens)


def h2o(x, l, a):
    s = x["score"][l].double()
    n = a.tokens
    recent = a.keep // 2  # recent = half
    cand = n - recent
    keep = torch.ones(1, n, dtype=torch.bool)
    keep[0, :cand] = ~first_k(-s[:cand], n - a.keep)  # lowest first, ties lower index
    return keep


def tova(x, l, a):
    s = x["last_attn"][l].double().mean(dim=0)
    s[-1] = s[:-1].max() + 1  # kvpress: the last token is padded with max + 1
    return first_k(s, a.keep).view(1, -1)


POLICIES = [("snapkv", snapkv), ("criticalkv", criticalkv), ("adakv", adakv), ("h2o", h2o),
            ("tova", tova)]


def load(a):
    L, Ly, Hq, Hkv = a.tokens, a.layers, a.q_heads, a.kv_heads
    raw = np.fromfile(a.input, dtype=np.float32)
    sizes = [("window_attn", (Ly, Hq, L)), ("vnorm", (Ly, Hkv, L)), ("score", (Ly, L)),
             ("last_attn", (Ly, Hq, L))]
    x, off = {}, 0
    for name, shape in sizes:
        n = int(np.prod(shape))
        x[name] = torch.from_numpy(raw[off:off + n].reshape(shape))
        off += n
    if off != raw.size:
        sys.exit(f"policy_decision_torch: {a.input} holds {raw.size} floats, expected {off}")
    return x


def main():
    p = argparse.ArgumentParser()
    for k in ("layers", "q_heads", "kv_heads", "tokens", "keep", "window", "kernel", "reps"):
        p.add_argument("--" + k.replace("_", "-"), type=int, required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", default="1,2")
    a = p.parse_args()
    x = load(a)
    threads = [int(t) for t in a.threads.split(",")]
    backend = [ln for ln in torch.__config__.parallel_info().splitlines() if "backend" in ln]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads by default, "
          f"{backend[0].strip() if backend else 'parallel backend unknown'}", flush=True)
    with open(a.output, "wb") as out:
        for name, rule in POLICIES:
            masks = None
            for t in threads:
                torch.set_num_threads(t)
                times = []
                # One thread: this thread's CPU time (robust to a shared
                # machine; the ops run on the calling thread); more: wall.
                clock = time.thread_time if t == 1 else time.perf_counter
                for r in range(a.reps + 1):  # the first is a warm-up
                    t0 = clock()
                    got = [rule(x, l, a) for l in range(a.layers)]
                    dt = clock() - t0
                    if r > 0:
                        times.append(dt)
                m = torch.stack(got).to(torch.uint8).numpy()
                if masks is None:
                    masks = m
                elif not np.array_equal(masks, m):
                    sys.exit(f"policy_decision_torch: {name} kept other sets on {t} threads")
                print(f"time {name} {t} {statistics.median(times) * 1e3:.3f}", flush=True)
            out.write(masks.tobytes())


if __name__ == "__main__":
    main()
