#!/usr/bin/env python3
"""Bytes saved for backward over one training step of the example GPT, one line per policy: runs
train_gpt with --trace for each, reads the traces' saved-bytes counter track and draws them on one
time axis as an SVG (by hand: no plotting dependency).

    python3 benchmarks/memory_timeline.py --train-gpt build/release/examples/train_gpt \
        --out benchmarks/memory_timeline.svg [--policies none,blocks,sqrt,binomial:2] [--layers 8]
"""
import argparse
import json
import os
import subprocess
import tempfile


def saved_over_time(trace_path):
    """(ms since the trace started, saved MiB) at every change of the books, and the step's spans."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    points = [(e["ts"] / 1000.0, e["args"]["saved bytes"] / 2**20) for e in events if e["ph"] == "C"]
    replays = sum(1 for e in events if e["ph"] == "B" and e["cat"] == "replay")
    return points, replays


def svg(lines, path, title):
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    W, H, m = 720, 420, 60
    t1 = max(p[0] for pts, _ in lines.values() for p in pts)
    v1 = max(p[1] for pts, _ in lines.values() for p in pts) * 1.05
    X = lambda t: m + t / t1 * (W - 2 * m)
    Y = lambda v: H - m - v / v1 * (H - 2 * m)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W/2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{m}" y1="{H-m}" x2="{W-m}" y2="{H-m}" stroke="black"/>',
           f'<line x1="{m}" y1="{m}" x2="{m}" y2="{H-m}" stroke="black"/>',
           f'<text x="{W/2}" y="{H-20}" text-anchor="middle">time in the step (ms): forward, then backward with its replays</text>',
           f'<text x="15" y="{H/2}" transform="rotate(-90 15 {H/2})" text-anchor="middle">MiB saved for backward</text>']
    step = 10 ** max(0, len(str(int(t1))) - 1)
    t = 0
    while t <= t1:
        out.append(f'<text x="{X(t):.1f}" y="{H-m+16}" text-anchor="middle">{t:g}</text>')
        t += step
    vstep = max(1, round(v1 / 5))
    v = 0
    while v <= v1:
        out.append(f'<text x="{m-6}" y="{Y(v)+4:.1f}" text-anchor="end">{v:g}</text>')
        out.append(f'<line x1="{m}" y1="{Y(v):.1f}" x2="{W-m}" y2="{Y(v):.1f}" stroke="#ddd"/>')
        v += vstep
    for i, (name, (pts, replays)) in enumerate(lines.items()):
        c = colors[i % len(colors)]
        # A step line: the books hold a value until the next change.
        coords = []
        for k, (t, v) in enumerate(pts):
            if k:
                coords.append(f"{X(t):.1f},{Y(pts[k-1][1]):.1f}")
            coords.append(f"{X(t):.1f},{Y(v):.1f}")
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{" ".join(coords)}"/>')
        peak = max(v for _, v in pts)
        out.append(f'<text x="{W-m-230}" y="{m+16*i}" fill="{c}">{name}: peak {peak:.1f} MiB, {replays} replays</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default="none,blocks,sqrt,binomial:2")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    lines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in a.policies.split(","):
            trace = os.path.join(tmp, "trace.json")
            subprocess.run([a.train_gpt, "--steps", "1", "--layers", str(a.layers), "--sample", "0",
                            "--legible-floor", "0", "--dropout", "0.1", "--policy", policy, "--trace", trace,
                            "--out", os.path.join(tmp, "w.safetensors")], check=False, stdout=subprocess.DEVNULL)
            lines[policy] = saved_over_time(trace)
            pts, replays = lines[policy]
            print(f"{policy}: peak {max(v for _, v in pts):.2f} MiB saved, {replays} replay spans, "
                  f"step {pts[-1][0]:.0f} ms traced")
    svg(lines, a.out, f"remat: bytes saved for backward over one step of the example GPT ({a.layers} layers)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
