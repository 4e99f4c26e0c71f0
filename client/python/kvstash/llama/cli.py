"""cli.py - `python3 -m kvstash.llama score|generate`: kvstash-llama's
commands over the PyTorch forward pass (client/llama/main.c).

  score     per-token negative log-likelihood of a text file's stories
            (separated by <|endoftext|>, each BOS-prefixed and truncated to
            the model's context); the last line of stdout is one JSON object:
            nll, ppl, tokens, stories, kv_bytes_peak, kv_bytes_mean, ...
  generate  text from a prompt (greedy, or sampled with --temperature)

The options are kvstash-llama's, with the same defaults and meanings, so a
test can run both with one argument list. Exit status: 0 ok, 1 runtime error
(model, daemon, policy), 2 usage.
"""
import argparse
import math
import os
import sys
from typing import List, Optional, Tuple

from . import policies

MAX_BATCH = 64


class UsageError(Exception):
    """A bad command line (exit status 2)."""


def _u32(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        v = -1
    if not 0 <= v <= 0xFFFFFFFF or not text.isdigit():
        raise argparse.ArgumentTypeError(f"needs a non-negative integer, got '{text}'")
    return v


def _temperature(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        t = math.nan
    if not 0 <= t <= 100:
        raise argparse.ArgumentTypeError(f"needs a number in [0, 100], got '{text}'")
    return t


def _key_value(text: str) -> Tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got '{text}'")
    return key, value


def parser() -> argparse.ArgumentParser:
    shared = os.environ.get("KVSTASH_SHARED_DIR", "../shared")
    p = argparse.ArgumentParser(
        prog="python3 -m kvstash.llama",
        description="A llama2.c model in PyTorch whose KV cache lives in kvstashd.")
    p.add_argument("cmd", choices=("score", "generate"))
    p.add_argument("--model", default=os.path.join(shared, "data", "stories260K.bin"),
                   help="llama2.c checkpoint (default ../shared/data/stories260K.bin)")
    p.add_argument("--tokenizer", help="tokenizer.bin (default tok512.bin beside the model)")
    p.add_argument("--policy", default="full", help="kvstashd policy (default full)")
    p.add_argument("--set", dest="sets", action="append", type=_key_value, default=[],
                   metavar="KEY=VALUE", help="a policy parameter (repeatable; wins over --budget)")
    p.add_argument("--budget", type=_u32, default=0,
                   help="tokens per layer, mapped to the policy's own parameters")
    p.add_argument("--demote", choices=("off", "int8", "int4", "int2"), default=None,
                   help="all but the newest 8 tokens per list in that tier (default off)")
    p.add_argument("--int8", choices=("on", "off"), default=None,
                   help="the same as --demote int8 / off")
    p.add_argument("--socket", help="kvstashd's socket (default: the binding's default)")
    p.add_argument("--no-daemon", action="store_true",
                   help="plain in-process KV array instead of kvstashd")
    p.add_argument("--kv-dtype", "--dtype", dest="dtype", choices=("fp16", "bf16", "fp32"),
                   default="fp16",
                   help="the element type K and V are stored in, in kvstashd's pool (default "
                        "fp16, what engines keep; --dtype is the same option)")
    p.add_argument("--block-tokens", type=_u32, default=4, help="the pool's block size (default 4)")
    p.add_argument("--model-name", help="the pool's model name (default: the file's base name)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs (default cpu); cuda needs a pool in GPU memory "
                        "(kvstashd --backend cuda) or --no-daemon, and a CUDA build of torch")
    p.add_argument("--threads", type=_u32, default=0, help="torch threads (default: torch's)")
    p.add_argument("--text", default=os.path.join(shared, "data", "tinystories_val_dev.txt"),
                   help="score: stories separated by <|endoftext|>")
    p.add_argument("--stories", type=_u32, default=0, help="score: only the first N stories")
    p.add_argument("--prompt-tokens", type=_u32, default=0,
                   help="score: the first P tokens of a story are a prompt (one prefill step)")
    p.add_argument("--per-token", help="score: write one line per scored token: story position "
                   "logprob")
    p.add_argument("--batch", type=_u32, default=8,
                   help="score: stories side by side, each its own sequence (default 8)")
    p.add_argument("--quiet", action="store_true", help="score: no per-story lines on stderr")
    p.add_argument("--prompt", default="Once upon a time", help="generate: the prompt")
    p.add_argument("--steps", type=_u32, default=256, help="generate: tokens at most")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="generate: 0 = greedy, else sample softmax(logits / T)")
    p.add_argument("--seed", type=_u32, default=1, help="generate: sampling seed (default 1)")
    p.add_argument("--watch", type=_u32, default=0,
                   help="generate: every N tokens, show what the cache holds (stderr)")
    return p


def check(o: argparse.Namespace) -> None:
    """main.c parse()'s checks and derived defaults."""
    if not 1 <= o.batch <= MAX_BATCH:
        raise UsageError(f"--batch must be in 1..{MAX_BATCH}")
    if not 1 <= o.block_tokens <= 4096:
        raise UsageError("--block-tokens must be in 1..4096")
    if o.tokenizer is None:
        o.tokenizer = os.path.join(os.path.dirname(o.model), "tok512.bin")
    if o.model_name is None:
        o.model_name = os.path.basename(o.model).split(".", 1)[0]
    if o.demote is None:
        o.demote = "int8" if o.int8 == "on" else "off"
    if o.no_daemon and (o.budget or o.demote != "off" or o.sets or o.policy != "full"):
        raise UsageError("--no-daemon runs the full cache only (no --policy, --set, --budget, "
                         "--int8 or --demote)")


def main(argv: Optional[List[str]] = None) -> int:
    try:
        o = parser().parse_args(argv)
        check(o)
        if not o.no_daemon:  # the --budget mapping's and the parameters' usage errors
            policies.resolve(o.policy, o.sets, o.budget, o.demote, o.block_tokens, 1 << 20)
    except (UsageError, policies.PolicyError) as e:
        print(f"kvstash-torch: {e}", file=sys.stderr)
        return 2
    import torch  # after the command line is known good: the import takes seconds

    from .cache import CacheError
    from .checkpoint import CheckpointError
    from .commands import cmd_generate, cmd_score
    from .tokenizer import TokenizerError
    if o.threads:
        torch.set_num_threads(o.threads)
    try:
        with torch.no_grad():
            return cmd_score(o) if o.cmd == "score" else cmd_generate(o)
    except (CheckpointError, TokenizerError, CacheError, policies.PolicyError) as e:
        print(f"kvstash-torch: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the binding's errors (kvstash.KvstashError and its kinds)
        import kvstash
        if isinstance(e, kvstash.KvstashError):
            print(f"kvstash-torch: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise
