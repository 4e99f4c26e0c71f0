#!/usr/bin/python3
"""tests/quality/run.py - the quality benchmark: perplexity against KV memory
for every policy (issue 5, docs/quality/README.md).

It starts its own kvstashd on a temporary socket, runs `kvstash-llama score`
once for the full cache and once per policy x budget x demotion setting
(--demote off,int8,int4,int2: all but the newest 8 tokens of each list in
that tier; K/V in --kv-dtype pools, fp16 by default), and writes, under --out, NAME.csv, NAME.md (a Markdown table with the exact
command that made it) and NAME.svg (perplexity against mean KV bytes per
sequence, one line per policy; written by hand, no plotting library).

    /usr/bin/python3 tests/quality/run.py --build build --stories 200 \\
        --model ../shared/data/stories260K.bin --name stories260K

A run that fails (for instance --demote int2 against a pool whose blocks
cannot hold an INT2 block) is a row with status "error" and its message, not a failed
benchmark; the exit status is 1 only when the full-cache run fails or the
daemon cannot start. Standard library only.
"""
import argparse
import concurrent.futures
import csv
import html
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

POLICIES = ["streaming", "h2o", "tova", "ov_block", "snapkv", "adakv", "criticalkv",
            "criticalkv_ada", "confkv", "weightedkv", "reviver"]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def parse_args(argv):
    shared = os.environ.get("KVSTASH_SHARED_DIR", os.path.join(REPO, "..", "shared"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"),
                    help="build directory with daemon/kvstashd and client/llama/kvstash-llama")
    ap.add_argument("--daemon", default=None, help="kvstashd (default: BUILD/daemon/kvstashd)")
    ap.add_argument("--llama", default=None,
                    help="kvstash-llama (default: BUILD/client/llama/kvstash-llama)")
    ap.add_argument("--model", default=os.path.join(shared, "data", "stories260K.bin"))
    ap.add_argument("--tokenizer", default=None, help="default: tok512.bin beside the model")
    ap.add_argument("--text", default=os.path.join(shared, "data", "tinystories_val_dev.txt"))
    ap.add_argument("--stories", type=int, default=200)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; `full` always runs as the baseline and, when "
                    "listed, once more per --demote tier other than off: the whole cache "
                    "demoted, nothing evicted (KIVI's setting)")
    ap.add_argument("--budgets", default="16,32,64,128", help="tokens per layer, comma-separated")
    ap.add_argument("--demote", default=None,
                    help="comma-separated tiers held tokens are demoted to: off, int8, int4, int2 "
                         "(default off,int8)")
    ap.add_argument("--int8", default=None, help="off, on, or off,on: --demote off / int8")
    ap.add_argument("--demote-keep", default="0",
                    help="comma-separated shares for the storage option demote_keep (precision "
                    "by importance: that share of the demotable tokens, the most attended, stays "
                    "at full precision), each run with every --demote tier but off (default 0)")
    ap.add_argument("--block-tokens", type=int, default=0,
                    help="kvstash-llama --block-tokens (0: its default, 4)")
    ap.add_argument("--kv-dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                    help="the pools' element type (kvstash-llama --kv-dtype; default fp16). "
                         "Shares are always of an fp16 cache of every token")
    ap.add_argument("--set", action="append", default=[], metavar="POLICY:KEY=VALUE",
                    help="an extra parameter for one policy (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch", type=int, default=8, help="kvstash-llama --batch")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "quality"))
    ap.add_argument("--name", default=None, help="file name stem (default: the model's name)")
    ap.add_argument("--pool-mb", type=int, default=512)
    ap.add_argument("--timeout", type=int, default=7200, help="seconds per run")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw OUT/NAME.svg and .md from OUT/NAME.csv")
    args = ap.parse_args(argv)
    if args.name is None:
        args.name = os.path.basename(args.model).split(".")[0]
    return args


class Daemon:
    """kvstashd on a fresh temporary socket; stopped with SIGTERM."""

    def __init__(self, binary, pool_mb):
        self.dir = tempfile.mkdtemp(prefix="kvstash-quality.")
        self.sock = os.path.join(self.dir, "kvstashd.sock")
        self.log = open(os.path.join(self.dir, "kvstashd.log"), "wb")
        self.proc = subprocess.Popen([binary, "--socket", self.sock, "--pool-mb", str(pool_mb),
                                      "--log-level", "warn"], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock + ".fd") or not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvstashd did not start: " + self.log_tail())
            time.sleep(0.05)

    def log_tail(self):
        try:
            with open(os.path.join(self.dir, "kvstashd.log"), "rb") as f:
                return f.read().decode("utf-8", "replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


DEMOTE_ORDER = ["off", "int8", "int4", "int2"]
DASH = {"off": "", "int8": "6,3", "int4": "2,2", "int2": "1,3"}


def demote_modes(args):
    """--demote's tiers (--int8's on/off mapped to int8/off), in order."""
    if args.demote is None:
        old = (args.int8 or "off,on").split(",")
        args.demote = ",".join({"on": "int8"}.get(m, m) for m in old)
    modes = args.demote.split(",")
    for m in modes:
        if m not in DEMOTE_ORDER:
            raise SystemExit(f"run.py: --demote takes off, int8, int4, int2; got {m!r}")
    return modes


def settings(args):
    """The grid's precision settings: (demote tier, demote_keep) pairs, off
    once and every other tier with each --demote-keep share."""
    keeps = [float(k) for k in args.demote_keep.split(",")]
    if any(not 0 <= k <= 1 for k in keeps):
        raise SystemExit(f"run.py: --demote-keep takes shares in [0, 1]; got {args.demote_keep}")
    return list(dict.fromkeys((m, 0.0 if m == "off" else k) for m in demote_modes(args)
                              for k in keeps))


def setting(r):
    return (r["demote"], r.get("demote_keep") or 0.0)


def setting_label(st):
    return st[0] if not st[1] else f"{st[0]}, keep {st[1]:g}"


def setting_order(st):
    return (DEMOTE_ORDER.index(st[0]), st[1])


def row_settings(rows):
    return sorted({setting(r) for r in rows}, key=setting_order)


def score_cmd(args, llama, sock, policy, budget, demote, extra, keep=0.0):
    cmd = [llama, "score", "--model", args.model, "--text", args.text, "--stories",
           str(args.stories), "--batch", str(args.batch), "--quiet"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if sock is None:
        cmd += ["--no-daemon"]
    else:
        cmd += ["--socket", sock, "--kv-dtype", args.kv_dtype, "--policy", policy]
        if args.block_tokens:
            cmd += ["--block-tokens", str(args.block_tokens), "--model-name",
                    f"{args.name}-b{args.block_tokens}"]
        if budget:
            cmd += ["--budget", str(budget)]
        cmd += ["--demote", demote]
        if keep:
            cmd += ["--set", f"demote_keep={keep:g}"]
        for kv in extra:
            cmd += ["--set", kv]
    return cmd


def kv_fraction(r):
    """The bytes a run held as a share of an fp16 cache of every token at the
    same steps (kv_bytes_full_mean: the worker counts it at 2 bytes an
    element whatever the pool's dtype, so every run has the same one)."""
    return {"kv_fraction": r["kv_bytes_mean"] / r["kv_bytes_full_mean"]}


def run_one(cmd, timeout):
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout} s"}
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines:
        try:
            res = json.loads(lines[-1])
            res["status"] = "ok"
            res["wall"] = time.monotonic() - t0
            return res
        except json.JSONDecodeError:
            pass
    err = (p.stderr.strip().splitlines() or ["exit status %d" % p.returncode])[-1]
    return {"status": "error", "error": err.replace("kvstash-llama: ", "")}


FIELDS = ["model", "kv_dtype", "policy", "budget", "demote", "demote_keep", "status", "ppl", "nll", "tokens",
          "stories", "kv_bytes_mean", "kv_bytes_peak", "kv_bytes_full_mean", "kv_fraction",
          "ppl_vs_full", "evicted", "seconds", "error"]


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def fmt_cell(r):
    if r is None:
        return ""
    if r["status"] != "ok":
        return "error"
    return "%.3f (%.0f%%)" % (r["ppl"], 100 * r["kv_fraction"])


PARETO_SHARES = (0.5, 0.25, 0.125, 0.0625)


def pareto_lines(rows, full):
    """The best perplexity at or under each share of the fp16 cache's bytes
    (issue 15), with the cell that gets it: Markdown table lines."""
    out = ["| bytes, share of the fp16 cache | best perplexity | vs full | cell (policy, budget, "
           "demote) | its share |", "|---|---|---|---|---|"]
    ok = [r for r in rows if r["status"] == "ok"]
    for share in PARETO_SHARES:
        fit = [r for r in ok if r["kv_fraction"] <= share]
        if not fit:
            out.append(f"| ≤ {100 * share:g}% | none | | | |")
            continue
        b = min(fit, key=lambda r: r["ppl"])
        out.append(f"| ≤ {100 * share:g}% | {b['ppl']:.4f} | "
                   f"{100 * (b['ppl'] / full['ppl'] - 1):+.2f}% | {b['policy']}, {b['budget']}, "
                   f"{setting_label(setting(b))} | {100 * b['kv_fraction']:.1f}% |")
    return out


def full_demoted_lines(rows, full):
    """The whole cache, nothing evicted, demoted to each tier: Markdown lines
    (none when the grid did not list `full`)."""
    demoted = [r for r in rows if r["policy"] == "full"]
    if not demoted:
        return []
    out = ["\n## The whole cache demoted (policy full, nothing evicted)\n",
           "| demote | perplexity | vs full | share of the fp16 cache |", "|---|---|---|---|"]
    for r in sorted(demoted, key=lambda r: setting_order(setting(r))):
        label = setting_label(setting(r))
        if r["status"] != "ok":
            out.append(f"| {label} | error: `{r['error']}` | | |")
            continue
        out.append(f"| {label} | {r['ppl']:.4f} | {100 * (r['ppl'] / full['ppl'] - 1):+.2f}% "
                   f"| {100 * r['kv_fraction']:.1f}% |")
    return out


def write_md(path, args, rows, full, budgets, command, seconds):
    policies = [p for p in args.policies.split(",") if p != "full"]
    modes = row_settings(rows)
    out = []
    out.append(f"# Quality: {args.name}\n")
    out.append(f"Perplexity of `{os.path.basename(args.model)}` on the first "
               f"{full['stories']} stories of `{os.path.basename(args.text)}` "
               f"({full['tokens']} scored tokens), with the KV cache in kvstashd. "
               f"K and V in {args.kv_dtype} pools. Each cell: perplexity (mean KV bytes "
               "per sequence as stored, as a share of an fp16 cache of every token at the "
               "same steps: docs/quality/README.md \"How bytes are counted\"). Budgets are "
               "tokens per layer (`--budget`, mapped per policy as docs/quality/README.md "
               "says).\n")
    out.append(f"Full cache: **ppl {full['ppl']:.4f}** (nll {full['nll']:.6f}), mean KV "
               f"{full['kv_bytes_mean'] / 1024:.1f} KiB as stored "
               f"({100 * full['kv_fraction']:.0f}% of the fp16 cache's "
               f"{full['kv_bytes_full_mean'] / 1024:.1f} KiB), peak "
               f"{full['kv_bytes_peak'] / 1024:.1f} KiB per sequence.\n")
    out.append("\n## Pareto: the best cell at each memory share\n")
    out += pareto_lines(rows, full)
    out += full_demoted_lines(rows, full)
    for mode in modes:
        if not any(setting(r) == mode and r["policy"] != "full" for r in rows):
            continue  # the whole cache's rows only: in the section above
        out.append(f"\n## demote {setting_label(mode)}\n" if mode[0] != "off"
                   else "\n## all held tokens at full precision\n")
        out.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for p in policies:
            cells = []
            for b in budgets:
                r = next((x for x in rows if x["policy"] == p and x["budget"] == b
                          and setting(x) == mode), None)
                cells.append(fmt_cell(r))
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        errs = [x["error"] for x in rows if setting(x) == mode and x["status"] != "ok"]
        if errs:
            more = f" (and {len(errs) - 1} more errors like it)" if len(errs) > 1 else ""
            out.append(f"\nerror: `{errs[0]}`{more}")
    if seconds is not None:
        out.append(f"\nMade in {seconds / 60:.1f} min with:\n")
        out.append("```\n" + command + "\n```\n")
    else:
        out.append("\n" + command)
    with open(path, "w") as f:
        f.write("\n".join(out))


COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"]


def write_svg(path, args, rows, full):
    """Perplexity (y) against mean KV bytes per sequence (x, log scale)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    W, L, R, T, B = 760, 70, 190, 40, 50
    entries = 2 + len({(r["policy"], setting(r)) for r in ok})  # the legend's lines, at most
    H = max(480, T + 26 + 16 * entries)
    xs = [r["kv_bytes_mean"] for r in ok] + [full["kv_bytes_mean"]]
    ys = [r["ppl"] for r in ok] + [full["ppl"]]
    x0, x1 = math.log10(min(xs)) - 0.05, math.log10(max(xs)) + 0.05
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.08 or 0.1
    y0, y1 = y0 - pad, y1 + pad

    def px(v):
        return L + (math.log10(v) - x0) / (x1 - x0) * (W - L - R)

    def py(v):
        return T + (y1 - v) / (y1 - y0) * (H - T - B)

    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">'
         f'{html.escape(args.name)}: perplexity vs KV memory ({full["stories"]} stories)</text>']
    # axes and grid
    s.append(f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>')
    s.append(f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>')
    for k in range(6):
        yv = y0 + (y1 - y0) * k / 5
        s.append(f'<line x1="{L}" y1="{py(yv):.1f}" x2="{W - R}" y2="{py(yv):.1f}" '
                 'stroke="#ddd"/>')
        s.append(f'<text x="{L - 6}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>')
    e = math.floor(x0 - math.log10(1024))  # ticks at 1, 2, 5 x 10^e KiB
    while e <= x1:
        for m in (1, 2, 5):
            v = m * 10.0 ** e * 1024
            if x0 <= math.log10(v) <= x1:
                s.append(f'<line x1="{px(v):.1f}" y1="{T}" x2="{px(v):.1f}" y2="{H - B}" '
                         'stroke="#eee"/>')
                s.append(f'<text x="{px(v):.1f}" y="{H - B + 16}" text-anchor="middle">'
                         f'{m * 10.0 ** e:g} KiB</text>')
        e += 1
    s.append(f'<text x="{(L + W - R) / 2}" y="{H - 10}" text-anchor="middle">'
             'mean KV bytes per sequence (log scale)</text>')
    s.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(T + H - B) / 2})">perplexity</text>')
    # the full cache
    fx, fy = px(full["kv_bytes_mean"]), py(full["ppl"])
    s.append(f'<line x1="{L}" y1="{fy:.1f}" x2="{W - R}" y2="{fy:.1f}" stroke="black" '
             'stroke-dasharray="2,3"/>')
    s.append(f'<circle cx="{fx:.1f}" cy="{fy:.1f}" r="4" fill="black"/>')
    legend = [("full", "black", "")]
    demoted = sorted((r["kv_bytes_mean"], r["ppl"]) for r in ok if r["policy"] == "full")
    if demoted:
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in demoted + [(full["kv_bytes_mean"],
                                                                            full["ppl"])])
        s.append(f'<polyline points="{line}" fill="none" stroke="black" stroke-width="1.5"/>')
        for x, y in demoted:
            s.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="black"/>')
        legend.append(("full, demoted", "black", ""))
    policies = []
    for r in ok:
        if r["policy"] == "full":
            continue
        if r["policy"] not in policies:
            policies.append(r["policy"])
    for i, p in enumerate(policies):
        color = COLORS[i % len(COLORS)]
        for mode in row_settings(ok):
            dash = DASH[mode[0]]
            pts = sorted((r["kv_bytes_mean"], r["ppl"]) for r in ok
                         if r["policy"] == p and setting(r) == mode)
            if not pts:
                continue
            line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            s.append(f'<polyline points="{line}" fill="none" stroke="{color}" '
                     f'stroke-width="{2.5 if mode[1] else 1.5}" stroke-dasharray="{dash}"/>')
            for x, y in pts:  # squares: graded by importance (demote_keep)
                s.append(f'<rect x="{px(x) - 3:.1f}" y="{py(y) - 3:.1f}" width="6" height="6" '
                         f'fill="{color}"/>' if mode[1] else
                         f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>')
            legend.append((p + ("" if mode[0] == "off" else " " + setting_label(mode)), color,
                           dash))
    for i, (name, color, dash) in enumerate(legend):
        y = T + 10 + i * 16
        s.append(f'<line x1="{W - R + 12}" y1="{y}" x2="{W - R + 36}" y2="{y}" stroke="{color}" '
                 f'stroke-width="2" stroke-dasharray="{dash}"/>')
        s.append(f'<text x="{W - R + 42}" y="{y + 4}">{html.escape(name)}</text>')
    s.append("</svg>\n")
    with open(path, "w") as f:
        f.write("\n".join(s))


def read_csv(path):
    """Rows of a CSV this script wrote, numbers as numbers."""
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            for k in ("ppl", "nll", "kv_bytes_mean", "kv_bytes_peak", "kv_bytes_full_mean",
                      "kv_fraction", "ppl_vs_full", "seconds"):
                r[k] = float(r[k]) if r.get(k) else None
            r["demote_keep"] = float(r.get("demote_keep") or 0)
            for k in ("budget", "tokens", "stories", "evicted"):
                r[k] = int(r[k]) if r.get(k) else None
            if "demote" not in r:  # tables before --demote had an int8 column of off/on
                r["demote"] = {"on": "int8"}.get(r.get("int8"), "off")
            rows.append(r)
    return rows


def main(argv):
    args = parse_args(argv)
    if args.replot:
        stem = os.path.join(args.out, args.name)
        rows = read_csv(stem + ".csv")
        full = next(r for r in rows if r["policy"] == "full" and r["demote"] == "off")
        args.kv_dtype = full.get("kv_dtype") or "fp32"  # tables before --kv-dtype were fp32
        rows = [r for r in rows if r is not full]
        write_svg(stem + ".svg", args, rows, full)
        with open(stem + ".md") as f:  # keep how the table was made
            md = f.read()
        made = md[md.index("\nMade in"):].lstrip("\n") if "\nMade in" in md else ""
        budgets = sorted({r["budget"] for r in rows if r["policy"] != "full"})
        args.policies = ",".join(dict.fromkeys(r["policy"] for r in rows))
        write_md(stem + ".md", args, rows, full, budgets, made, None)
        print(f"wrote {stem}.svg and {stem}.md")
        return 0
    daemon_bin = args.daemon or os.path.join(args.build, "daemon", "kvstashd")
    llama = args.llama or os.path.join(args.build, "client", "llama", "kvstash-llama")
    for b in (daemon_bin, llama):
        if not os.access(b, os.X_OK):
            print(f"run.py: {b} is not an executable (build first)", file=sys.stderr)
            return 1
    budgets = [int(b) for b in args.budgets.split(",") if b]
    modes = settings(args)
    extra = {}
    for s in args.set:
        pol, _, kv = s.partition(":")
        extra.setdefault(pol, []).append(kv)
    os.makedirs(args.out, exist_ok=True)
    command = "/usr/bin/python3 tests/quality/run.py " + " ".join(shlex.quote(a) for a in argv)
    t0 = time.monotonic()
    d = Daemon(daemon_bin, args.pool_mb)
    try:
        full = run_one(score_cmd(args, llama, d.sock, "full", 0, "off", []), args.timeout)
        full.update(kv_fraction(full))
        if full["status"] != "ok":
            print(f"run.py: the full-cache run failed: {full['error']}", file=sys.stderr)
            return 1
        print(f"full: ppl {full['ppl']:.4f} ({full['tokens']} tokens, {full['seconds']:.0f} s)",
              flush=True)
        jobs = [(p, b, m) for m in modes for p in args.policies.split(",") if p != "full"
                for b in budgets]
        if "full" in args.policies.split(","):
            jobs = [("full", 0, m) for m in modes if m[0] != "off"] + jobs
        rows = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
            futs = {ex.submit(run_one, score_cmd(args, llama, d.sock, p, b, m[0],
                                                 extra.get(p, []), m[1]), args.timeout): (p, b, m)
                    for p, b, m in jobs}
            for fut in concurrent.futures.as_completed(futs):
                p, b, m = futs[fut]
                r = fut.result()
                r.update({"model": args.name, "policy": p, "budget": b, "demote": m[0],
                          "demote_keep": m[1], "kv_dtype": args.kv_dtype})
                cell = f"{p} budget {b} demote {setting_label(m)}"
                if r["status"] == "ok":
                    r.update(kv_fraction(r))
                    r["ppl_vs_full"] = r["ppl"] / full["ppl"]
                    print(f"{cell}: ppl {r['ppl']:.4f}, kv {100 * r['kv_fraction']:.0f}% "
                          f"({r['seconds']:.0f} s)", flush=True)
                else:
                    print(f"{cell}: error: {r['error']}", flush=True)
                rows.append(r)
    finally:
        d.stop()
    order = {p: i for i, p in enumerate(args.policies.split(","))}
    rows.sort(key=lambda r: (setting_order(setting(r)), order.get(r["policy"], 99), r["budget"]))
    full.update({"model": args.name, "policy": "full", "budget": 0, "demote": "off",
                 "demote_keep": 0.0,
                 "ppl_vs_full": 1.0})
    stem = os.path.join(args.out, args.name)
    write_csv(stem + ".csv", [full] + rows)
    write_md(stem + ".md", args, rows, full, budgets, command, time.monotonic() - t0)
    write_svg(stem + ".svg", args, rows, full)
    print(f"wrote {stem}.csv, {stem}.md, {stem}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
