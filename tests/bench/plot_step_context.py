#!/usr/bin/env python3
"""plot_step_context.py - draw bench_step_context's CSV (--csv) as an SVG:
a decode step's time (append + step + table reload, median) against the
context, both on log scales, one line per policy, with the 1 ms goal at 32k
tokens and a line of slope 1 (linear growth) for reference.

    tests/bench/plot_step_context.py OUT.svg RUN.csv [RUN.csv ...]

Several CSVs (e.g. runs at different head dims) are drawn as one series per
policy, in context order. Needs only the standard library.
"""
import csv
import html
import math
import sys

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#17becf"]
W, H, L, R, T, B = 760, 480, 70, 140, 40, 50


def read(paths):
    series = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                series.setdefault(row["policy"], []).append(
                    (int(row["context"]), float(row["total_us"]) / 1000.0))
    return {p: sorted(pts) for p, pts in series.items()}


def svg(series):
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts] + [1.0]
    x0, x1 = math.log2(min(xs)) - 0.3, math.log2(max(xs)) + 0.3
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))

    def px(v):
        return L + (math.log2(v) - x0) / (x1 - x0) * (W - L - R)

    def py(v):
        return T + (y1 - math.log10(v)) / (y1 - y0) * (H - T - B)

    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">'
         'kvstashd: one decode step against the context (32 layers x 8 KV heads)</text>',
         f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for e in range(y0, y1 + 1):
        v = 10.0 ** e
        s.append(f'<line x1="{L}" y1="{py(v):.1f}" x2="{W - R}" y2="{py(v):.1f}" stroke="#ddd"/>')
        s.append(f'<text x="{L - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g} ms</text>')
    for x in sorted(set(xs)):
        s.append(f'<line x1="{px(x):.1f}" y1="{T}" x2="{px(x):.1f}" y2="{H - B}" stroke="#eee"/>')
        s.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" text-anchor="middle">'
                 f'{x // 1024}k</text>')
    s.append(f'<text x="{(L + W - R) / 2}" y="{H - 10}" text-anchor="middle">'
             'tokens held per list (log scale)</text>')
    s.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(T + H - B) / 2})">time per decode step (log scale)</text>')
    # The goal: 1 ms at 32k tokens; and slope 1 from the smallest context's fastest point.
    s.append(f'<line x1="{L}" y1="{py(1):.1f}" x2="{W - R}" y2="{py(1):.1f}" stroke="black" '
             'stroke-dasharray="2,3"/>')
    s.append(f'<circle cx="{px(32768):.1f}" cy="{py(1):.1f}" r="4" fill="none" stroke="black"/>')
    xa = min(xs)
    ya = min(y for pts in series.values() for x, y in pts if x == xa)
    xb = max(xs)
    s.append(f'<line x1="{px(xa):.1f}" y1="{py(ya):.1f}" x2="{px(xb):.1f}" '
             f'y2="{py(ya * xb / xa):.1f}" stroke="#999" stroke-dasharray="6,4"/>')
    legend = [("goal: 1 ms at 32k", "black", "2,3"), ("linear growth", "#999", "6,4")]
    for i, (policy, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        s.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for x, y in pts:
            s.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>')
        legend.append((policy, color, ""))
    for i, (name, color, dash) in enumerate(legend):
        y = T + 10 + i * 16
        s.append(f'<line x1="{W - R + 12}" y1="{y}" x2="{W - R + 36}" y2="{y}" stroke="{color}" '
                 f'stroke-width="2" stroke-dasharray="{dash}"/>')
        s.append(f'<text x="{W - R + 42}" y="{y + 4}">{html.escape(name)}</text>')
    s.append("</svg>\n")
    return "\n".join(s)


def main(argv):
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    series = read(argv[2:])
    if not series:
        sys.stderr.write("plot_step_context.py: no rows in the CSVs\n")
        return 1
    with open(argv[1], "w") as f:
        f.write(svg(series))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
