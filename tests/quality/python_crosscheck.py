#!/usr/bin/python3
"""tests/quality/python_crosscheck.py - the cross-implementation report of
issue 13 (acceptance 2): the PyTorch worker (`python3 -m kvstash.llama`)
against the C worker (kvstash-llama) on many stories, written to
docs/quality/python.md.

It starts its own kvstashd on a temporary socket and, for each model, scores
the same stories with both workers: the full cache (every per-token
log-likelihood compared; the check holds them to 1e-4), then h2o, snapkv,
criticalkv and confkv at --budget 32 --int8 on (perplexities compared; the
check holds them to 0.1%), K/V in --kv-dtype pools (fp16 by default, the
workers' default). Runs are sequential, one torch thread, so that
the timings mean something on a shared machine.

    /usr/bin/python3 tests/quality/python_crosscheck.py --stories 200 \\
        --model ../shared/data/stories260K.bin \\
        --model .cache/models/stories15M.bin:.cache/models/tok32000.bin

Exit status 1 when a run fails or a result is outside its tolerance.
Standard library only (the workers bring numpy and torch).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from run import Daemon  # tests/quality/run.py: kvstashd on a temporary socket

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
POLICIES = ["h2o", "snapkv", "criticalkv", "confkv"]
FULL_TOLERANCE = 1e-4       # full, fp32 pools: per-token log-likelihood
# full, fp16/bf16 pools: the perplexity (client/python/tests/llama_helpers.py
# KV_DTYPE says why per-token equality cannot hold there)
FULL16_TOLERANCE = 1e-4
PPL_TOLERANCE = 1e-3


def parse_args(argv):
    shared = os.environ.get("KVSTASH_SHARED_DIR", os.path.join(REPO, "..", "shared"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"),
                    help="build directory with daemon/kvstashd and client/llama/kvstash-llama")
    ap.add_argument("--llama", default=None,
                    help="kvstash-llama (default: BUILD/client/llama/kvstash-llama)")
    ap.add_argument("--model", action="append", default=[], metavar="PATH[:TOKENIZER]",
                    help="a checkpoint (repeatable; default stories260K)")
    ap.add_argument("--text", default=os.path.join(shared, "data", "tinystories_val_dev.txt"))
    ap.add_argument("--stories", type=int, default=200)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--kv-dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                    help="the pools' element type, for both workers (default fp16)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--pool-mb", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "quality", "python.md"))
    args = ap.parse_args(argv)
    if not args.model:
        args.model = [os.path.join(shared, "data", "stories260K.bin")]
    if args.llama is None:
        args.llama = os.path.join(args.build, "client", "llama", "kvstash-llama")
    return args


def score(worker, args, model, tokenizer, sock, tmp, name, extra):
    """One scoring run: (summary, {(story, pos): logprob}, command)."""
    per_token = os.path.join(tmp, f"{worker}-{name}.tok")
    common = ["score", "--model", model, "--text", args.text, "--stories", str(args.stories),
              "--batch", str(args.batch), "--quiet", "--per-token", per_token,
              "--socket", sock, "--kv-dtype", args.kv_dtype, *extra]
    if tokenizer:
        common += ["--tokenizer", tokenizer]
    if worker == "c":
        cmd = [args.llama, *common]
    else:
        cmd = [sys.executable, "-m", "kvstash.llama", *common, "--threads", "1"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "client", "python")] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                         if p])
    env.setdefault("KVSTASH_LIB", os.path.join(args.build, "client", "libkvstash.so"))
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: exit {p.returncode}\n{p.stderr[-2000:]}")
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    summary["wall"] = time.monotonic() - t0
    lps = {}
    with open(per_token) as f:
        for line in f:
            story, pos, lp = line.split()
            lps[(int(story), int(pos))] = float(lp)
    return summary, lps, cmd


def compare(c, t):
    """Row of the report for one setting."""
    (cs, clp, _), (ts, tlp, _) = c, t
    assert clp.keys() == tlp.keys(), "the workers scored different tokens"
    diffs = [abs(clp[k] - tlp[k]) for k in clp]
    return {"c_ppl": cs["ppl"], "t_ppl": ts["ppl"], "rel": abs(ts["ppl"] - cs["ppl"]) / cs["ppl"],
            "max_diff": max(diffs), "within": sum(d <= FULL_TOLERANCE for d in diffs) / len(diffs),
            "tokens": cs["tokens"], "c_s": cs["seconds"], "t_s": ts["seconds"],
            "c_kv": cs["kv_bytes_mean"], "t_kv": ts["kv_bytes_mean"]}


def run_model(args, spec, sock, tmp):
    model, _, tokenizer = spec.partition(":")
    name = os.path.basename(model).split(".")[0]
    rows = []
    settings = [("full", [])] + [(p, ["--policy", p, "--budget", str(args.budget), "--int8",
                                      "on"]) for p in args.policies.split(",") if p]
    for policy, extra in settings:
        c = score("c", args, model, tokenizer, sock, tmp, f"{name}-{policy}", extra)
        t = score("torch", args, model, tokenizer, sock, tmp, f"{name}-{policy}", extra)
        row = compare(c, t)
        row.update(model=name, policy=policy,
                   budget="-" if policy == "full" else str(args.budget),
                   int8="off" if policy == "full" else "on")
        if policy != "full":
            row["ok"] = row["rel"] <= PPL_TOLERANCE
        elif args.kv_dtype == "fp32":
            row["ok"] = row["max_diff"] <= FULL_TOLERANCE
        else:
            row["ok"] = row["rel"] <= FULL16_TOLERANCE
        rows.append(row)
        print(f"{name} {policy}: C ppl {row['c_ppl']:.6f}, torch {row['t_ppl']:.6f}, "
              f"rel {row['rel']:.2e}, max |d lp| {row['max_diff']:.2e}", file=sys.stderr)
    return rows


def write_md(path, args, rows, command):
    lines = [
        "# Quality: the PyTorch worker against the C worker",
        "",
        f"The same {args.stories} stories of `tinystories_val_dev.txt`, scored by "
        "`python3 -m kvstash.llama score` (PyTorch, fp32 arithmetic, one thread) and by "
        "`kvstash-llama score` (C), both with their KV cache in one kvstashd "
        f"(`--kv-dtype {args.kv_dtype}`), `--batch "
        f"{args.batch}`. The check (client/python/tests/test_llama_crosscheck.py, in CI on 3 "
        f"stories) holds `full`'s per-token log-likelihoods to {FULL_TOLERANCE:g} in fp32 "
        f"pools (its perplexity to {FULL16_TOLERANCE:g} relative in fp16 or bf16 ones: "
        "rounding to fp16 turns the workers' last-bit fp32 differences into whole fp16 steps "
        "of stored K/V elements now and then) and the "
        f"policies' perplexities (`--budget {args.budget} --int8 on`) to "
        f"{PPL_TOLERANCE * 100:g}%.",
        "",
        "| model | policy | budget | int8 | tokens | C ppl | torch ppl | rel. diff | "
        "max per-token Δ log p | tokens within 1e-4 | KV mean C / torch (bytes) | "
        "C s | torch s | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['budget']} | {r['int8']} | {r['tokens']} | "
            f"{r['c_ppl']:.6f} | {r['t_ppl']:.6f} | {r['rel']:.2e} | {r['max_diff']:.2e} | "
            f"{r['within'] * 100:.2f}% | {r['c_kv']:.0f} / {r['t_kv']:.0f} | {r['c_s']:.1f} | "
            f"{r['t_s']:.1f} | {'pass' if r['ok'] else 'FAIL'} |")
    lines += [
        "",
        "Notes:",
        "",
        "- Both workers compute in fp32 but not in the same order (torch's matrix products and "
        "softmax against kvstash-llama's 32-lane dot products and the decode-attention kernel's "
        "polynomial exp), so per-token log-likelihoods differ in the fifth or sixth decimal "
        "when the two caches hold the same tokens.",
        "- A policy that ranks tokens can meet a near tie; a difference of 1e-7 in an attention "
        "probability then evicts another token and the two runs of that story part ways (snapkv "
        "shows it most). kvstash-llama does the same against itself: its generic and AVX2 "
        "kernel builds (`KVSTASH_KERNEL_ISA=generic`) part ways at the same tokens. So per-token "
        "equality under eviction is no property of either worker; the perplexity over many "
        "stories is what agrees.",
        "- The torch worker is slower: Debian's python3-torch multiplies matrices with the "
        "reference BLAS (`BLAS_INFO=generic`, netlib `libblas.so.3`), and each step pays the "
        "binding's append, table and step calls per sequence in Python.",
        "",
        "Made with:",
        "",
        "```",
        command,
        "```",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv):
    args = parse_args(argv)
    daemon = Daemon(os.path.join(args.build, "daemon", "kvstashd"), args.pool_mb)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvstash-pycheck.") as tmp:
            for spec in args.model:
                rows += run_model(args, spec, daemon.sock, tmp)
    finally:
        daemon.stop()
    command = shlex.join(["/usr/bin/python3", os.path.relpath(__file__, REPO), *argv])
    write_md(args.out, args, rows, command)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
