"""commands.py - the score and generate commands of `python3 -m kvstash.llama`
(client/llama/main.c cmd_score, cmd_generate) over the PyTorch forward pass.

cli.py parses and checks the command line first, so that a usage error
costs no torch import; this module does the work.
"""
import argparse
import bisect
import itertools
import json
import math
import sys
import time
from typing import List, Optional, Tuple

import numpy as np

from . import policies
from .cache import CacheError
from .checkpoint import Checkpoint
from .model import Llama, logprob
from .pool import PoolView
from .runner import Lane, Runner, make_caches
from .tokenizer import TOK_BOS, TOK_EOS, Tokenizer

STORY_SEP = b"<|endoftext|>"
WORKER_NAME = "kvstash-torch"


class Setup:
    """Model, tokenizer, session and policy of one run."""

    def __init__(self, o: argparse.Namespace, lanes: int):
        self.o = o
        self.ckpt = Checkpoint(o.model)
        self.model = Llama(self.ckpt)
        device = "cpu"
        self.tok = Tokenizer(o.tokenizer, self.model.c.vocab_size)
        self.session = None
        self.policy = None
        view = None
        if not o.no_daemon:
            self.policy = policies.resolve(o.policy, o.sets, o.budget, o.demote, o.block_tokens,
                                           self.model.c.seq_len)
            self.session = attach(o, self.model)
            s = self.session
            device = pool_device(o, s)
            view = PoolView(s.pool_tensor(), s.block_bytes, self.model.c.n_kv_heads,
                            o.block_tokens, self.model.c.head_size, o.dtype)
        elif o.device == "cuda":
            device = "cuda"
        self.model.to(device)
        caches = make_caches(self.model, lanes, self.session, view, self.policy)
        self.run = Runner(self.model, caches, view, self.policy)

    def close(self) -> None:
        try:
            self.run.close()
        finally:
            if self.session is not None:
                self.session.detach()


def attach(o: argparse.Namespace, model: Llama):
    """A session on the model's pool (geometry as kvstash-llama states it,
    so C and torch workers share one pool)."""
    import kvstash
    c = model.c
    geo = kvstash.Geometry(layers=c.n_layers, q_heads=c.n_heads, kv_heads=c.n_kv_heads,
                           head_dim=c.head_size, block_tokens=o.block_tokens, dtype=o.dtype,
                           rope_theta=10000.0)
    return kvstash.Session.attach(model=o.model_name, geometry=geo, socket=o.socket,
                                  worker_name=WORKER_NAME)


def pool_device(o: argparse.Namespace, session) -> str:
    """The torch device the pass runs on: the pool's GPU for --device cuda
    (the pool must be in GPU memory), the CPU for --device cpu (the pool
    must be in host memory)."""
    if o.device == "cuda" and session.backend != "cuda":
        raise CacheError(f"--device cuda: the pool is on kvstashd's {session.backend!r} "
                         f"backend (host memory); start kvstashd with --backend cuda")
    if o.device == "cpu" and session.backend == "cuda":
        raise CacheError("the pool is in GPU memory (kvstashd --backend cuda): run with "
                         "--device cuda")
    return f"cuda:{session.device}" if o.device == "cuda" else "cpu"


# ---- score ---------------------------------------------------------------------

def read_stories(path: str, limit: int) -> List[bytes]:
    """The stories of a text file: split at <|endoftext|>, whitespace
    trimmed, empty ones skipped (main.c next_story)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise CacheError(f"cannot open {path}: {e.strerror}") from None
    text = text.split(b"\0", 1)[0]
    out = []
    for part in text.split(STORY_SEP):
        s = part.strip(b" \n\r\t")
        if s:
            out.append(s)
            if limit and len(out) == limit:
                break
    return out


def lane_start(setup: Setup, ln: Lane, stories: List[bytes], nxt: List[int]) -> bool:
    """Give an idle lane the next story; False when none is left."""
    ctx = setup.model.c.seq_len
    while nxt[0] < len(stories):
        ids = setup.tok.encode(stories[nxt[0]], bos=True)
        ln.ids = ids
        ln.n = min(len(ids), ctx)
        ln.story = nxt[0]
        nxt[0] += 1
        if ln.n < 2:
            continue  # nothing to predict
        ln.cache.seq_begin(f"story {ln.story}")
        ln.pos, ln.nll, ln.lp, ln.busy = 0, 0.0, [], True
        return True
    return False


def cmd_score(o: argparse.Namespace) -> int:
    stories = read_stories(o.text, o.stories)
    setup = Setup(o, min(o.batch, len(stories)) if stories else 1)
    run = setup.run
    results: List[Optional[Tuple[float, int, int, List[float]]]] = [None] * len(stories)
    t0 = time.monotonic()
    nxt = [0]
    try:
        while True:
            active = [ln for ln in run.lanes if ln.busy or lane_start(setup, ln, stories, nxt)]
            if not active:
                break
            # Positions 0..n-2 predict tokens 1..n-1; the last token's own
            # prediction is past the story.
            logits = run.forward(active, [ln.ids[ln.pos] for ln in active])
            for b, ln in enumerate(active):
                lp = logprob(logits[b], ln.ids[ln.pos + 1])
                ln.lp.append(lp)
                ln.nll -= lp
                in_prompt = ln.pos + 1 < o.prompt_tokens
                ends_prompt = ln.pos + 1 == o.prompt_tokens
                run.end_token(ln, logits[b], ends_prompt, in_prompt)
                ln.pos += 1
                if ln.pos + 1 >= ln.n:
                    u = ln.cache.usage()
                    ln.cache.seq_end()
                    results[ln.story] = (ln.nll, ln.n - 1, u.evicted, ln.lp)
                    ln.busy = False
                    if not o.quiet:
                        print(f"story {ln.story}: {ln.n - 1} tokens, nll "
                              f"{ln.nll / (ln.n - 1):.4f}, evicted {u.evicted}", file=sys.stderr)
        secs = time.monotonic() - t0
    finally:
        setup.close()
    nll, tokens, evicted = 0.0, 0, 0
    lines = []
    for i, r in enumerate(results):
        if r is None:
            continue
        nll += r[0]
        tokens += r[1]
        evicted += r[2]
        lines.extend(f"{i} {k + 1} {lp!r}\n" for k, lp in enumerate(r[3]))
    if o.per_token is not None:
        try:
            with open(o.per_token, "w") as f:
                f.writelines(lines)
        except OSError as e:
            raise CacheError(f"cannot write {o.per_token}: {e.strerror}") from None
    mean = nll / tokens if tokens else 0.0
    t = run.totals
    steps = t.steps or 1
    summary = {
        "model": o.model_name, "policy": "none" if o.no_daemon else o.policy,
        "budget": o.budget, "int8": o.demote == "int8", "demote": o.demote,
        "daemon": not o.no_daemon,
        "kv_dtype": "fp32" if o.no_daemon else o.dtype, "nll": mean,
        "ppl": math.exp(mean), "tokens": tokens, "stories": len(stories),
        "kv_bytes_peak": t.bytes_peak, "kv_bytes_mean": t.bytes_sum / steps,
        "kv_bytes_full_mean": t.full_bytes_sum / steps, "evicted": evicted,
        "seconds": round(secs, 3), "worker": "torch", "batch": len(run.lanes),
    }
    print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


# ---- generate ------------------------------------------------------------------

MASK64 = (1 << 64) - 1


def rng_next(state: List[int]) -> int:
    """xorshift64* (main.c rng_next); state is a one-element list."""
    s = state[0]
    s ^= s >> 12
    s ^= (s << 25) & MASK64
    s ^= s >> 27
    state[0] = s
    return (s * 0x2545F4914F6CDD1D) & MASK64


def sample(logits: np.ndarray, temperature: float, state: List[int]) -> int:
    """Greedy at temperature 0 (the lowest index on ties), else a draw from
    softmax(logits / T) by one uniform and a cumulative sum (main.c sample)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = [float(x) for x in logits]
    mx = max(z)
    acc = list(itertools.accumulate(math.exp((x - mx) / temperature) for x in z))
    u = (rng_next(state) >> 11) / 9007199254740992.0 * acc[-1]
    i = bisect.bisect_right(acc, u)
    return min(i, len(z) - 1)


def watch_line(setup: Setup, ln: Lane) -> None:
    """What the cache holds: tokens per layer, evicted, and (with the daemon)
    the sequence's tiers from Stats."""
    u = ln.cache.usage()
    msg = (f"\n[kvstash pos {ln.pos}] {u.tokens / setup.model.c.n_layers:.1f} tokens/layer, "
           f"evicted {u.evicted}")
    seq = getattr(ln.cache, "seq", None)
    if seq is not None:
        import kvstash
        try:
            stats = kvstash.stats(socket=setup.o.socket)
        except kvstash.KvstashError:
            stats = {}
        for s in stats.get("sequences", []):
            if int(s.get("seq_id", s.get("seqId", 0))) == seq.id:
                tiers = [f"{t.get('tier')} {float(t.get('tokens', 0)):.0f} tok "
                         f"{float(t.get('bytes', 0)) / 1024:.1f} KiB" for t in s.get("tiers", [])]
                msg += "; kvstashd holds: " + ", ".join(tiers)
    print(msg, file=sys.stderr)


def cmd_generate(o: argparse.Namespace) -> int:
    setup = Setup(o, 1)
    try:
        run, tok = setup.run, setup.tok
        ln = run.lanes[0]
        ids = tok.encode(o.prompt.encode(), bos=True)
        ctx = setup.model.c.seq_len
        if len(ids) > ctx:
            raise CacheError(f"the prompt has {len(ids)} tokens; the model's context is {ctx}")
        ln.cache.seq_begin("generate")
        state = [(o.seed * 0x9E3779B97F4A7C15 + 1) & MASK64]
        token, generated = ids[0], 0
        out = sys.stdout.buffer
        ln.pos = 0
        while ln.pos < ctx:
            logits = run.forward([ln], [token])[0]
            prompt = ln.pos + 1 < len(ids)
            run.end_token(ln, logits, ln.pos + 1 == len(ids), prompt)
            nxt = ids[ln.pos + 1] if prompt else sample(logits, o.temperature, state)
            if not prompt and (nxt in (TOK_BOS, TOK_EOS) or generated == o.steps):
                break
            out.write(tok.decode(token, nxt))  # no leading space after BOS
            out.flush()
            generated += 0 if prompt else 1
            token = nxt
            if o.watch and not prompt and generated % o.watch == 0:
                watch_line(setup, ln)
            ln.pos += 1
        out.write(b"\n")
        out.flush()
        if o.watch and generated % o.watch:
            watch_line(setup, ln)
        ln.cache.seq_end()
    finally:
        setup.close()
    return 0
