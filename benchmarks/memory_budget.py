#!/usr/bin/env python3
"""Step time against a hard memory budget (remat::MemoryBudget) for the GPT `small` and `deep`
configurations and the U-Net-like model, next to hand-placed checkpointing at the same memory.
Runs bench_memory_budget once per model (settings alternate within each of its rounds), writes the
rows as CSV, the curves as SVG, and prints a table.
usage: memory_budget.py --bin BUILD/benchmarks --out DIR [--rounds 3] [--steps 2] [--svg PATH]"""
import argparse
import csv
import json
import os
import subprocess
import sys

from run import CONFIGS

UNET = dict(layers=6, width=512, context=128, batch=8, vocab=256, heads=4)
MODELS = [("small", "gpt", CONFIGS["small"], "blocks,sqrt,budget:48"),
          ("deep", "gpt", CONFIGS["deep"], "blocks,sqrt,budget:24"),
          ("unet", "unet", UNET, "")]


def run(binary, model, cfg, hand, rounds, steps):
    cmd = [binary, "--model", model, "--rounds", str(rounds), "--steps", str(steps)]
    for k, v in cfg.items():
        cmd += [f"--{k}", str(v)]
    if hand:
        cmd += ["--hand", hand]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"benchmark failed: {' '.join(cmd)}\n{res.stderr}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def svg(panels, path):
    """One panel per model: median step time against saved-bytes peak (fraction of the
    no-checkpoint peak); lines for the budget (searched and planned), dots for hand placement."""
    W, H, m, gap = 300, 300, 50, 20
    total_w = len(panels) * (W + gap) + gap
    colors = {"budget": "#1f77b4", "budget+plan": "#2ca02c", "hand": "#d62728"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{H + 40}" font-family="sans-serif" font-size="11">',
           f'<rect width="{total_w}" height="{H + 40}" fill="white"/>',
           f'<text x="{total_w / 2}" y="16" text-anchor="middle" font-size="13">remat MemoryBudget: step time vs peak saved bytes '
           '(fraction of no checkpointing)</text>']
    for i, (name, rows) in enumerate(panels):
        ox, oy = gap + i * (W + gap), 30
        ok = [r for r in rows if "median_ms" in r]
        t_max = max(r["median_ms"] for r in ok) * 1.05
        X = lambda f: ox + m + f * (W - m - 10)
        Y = lambda t: oy + H - m - t / t_max * (H - m - 20)
        out += [f'<text x="{ox + W / 2}" y="{oy + 12}" text-anchor="middle">{name}</text>',
                f'<line x1="{X(0)}" y1="{Y(0)}" x2="{X(1.05)}" y2="{Y(0)}" stroke="black"/>',
                f'<line x1="{X(0)}" y1="{Y(0)}" x2="{X(0)}" y2="{Y(t_max)}" stroke="black"/>',
                f'<text x="{X(0.5)}" y="{Y(0) + 30}" text-anchor="middle">peak saved / no-checkpoint peak</text>',
                f'<text x="{ox + 12}" y="{Y(t_max / 2)}" transform="rotate(-90 {ox + 12} {Y(t_max / 2)})" '
                'text-anchor="middle">ms per step (median)</text>']
        for f in (0, 0.25, 0.5, 0.75, 1.0):
            out.append(f'<text x="{X(f)}" y="{Y(0) + 14}" text-anchor="middle">{f:g}</text>')
        for k in range(5):
            t = t_max * k / 4
            out.append(f'<text x="{X(0) - 4}" y="{Y(t) + 4}" text-anchor="end">{t:.0f}</text>')
        for pol in ("budget", "budget+plan"):
            pts = sorted((r["saved_peak"] / r["free_peak"], r["median_ms"]) for r in ok if r["policy"] == pol)
            out.append(f'<polyline fill="none" stroke="{colors[pol]}" stroke-width="1.5" points="' +
                       " ".join(f"{X(f):.1f},{Y(t):.1f}" for f, t in pts) + '"/>')
        for r in ok:
            if r["policy"] in ("none", "budget", "budget+plan"):
                continue
            f = r["saved_peak"] / r["free_peak"]
            out.append(f'<circle cx="{X(f):.1f}" cy="{Y(r["median_ms"]):.1f}" r="3.5" fill="{colors["hand"]}"/>')
            out.append(f'<text x="{X(f) + 5:.1f}" y="{Y(r["median_ms"]) - 5:.1f}" fill="{colors["hand"]}">{r["policy"]}</text>')
        none = [r for r in ok if r["policy"] == "none"]
        if none:
            out.append(f'<circle cx="{X(1):.1f}" cy="{Y(none[0]["median_ms"]):.1f}" r="3.5" fill="black"/>')
        for j, (label, c) in enumerate([("budget (searched)", colors["budget"]), ("budget (static plan)", colors["budget+plan"]),
                                        ("hand-placed", colors["hand"]), ("no checkpointing", "black")]):
            out.append(f'<text x="{X(0.05)}" y="{oy + 30 + 13 * j}" fill="{c}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--svg", default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    binary = os.path.join(a.bin, "bench_memory_budget")
    panels, rows_all = [], []
    for name, model, cfg, hand in MODELS:
        rows = run(binary, model, cfg, hand, a.rounds, a.steps)
        for r in rows:
            r["config"] = name
        panels.append((name, rows))
        rows_all += rows
    keys = ["config", "model", "policy", "at", "budget", "free_peak", "saved_peak", "median_ms", "discards",
            "recomputes", "recomputed_gflop", "decisions", "infeasible_least", "ms"]
    with open(os.path.join(a.out, "memory_budget.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows_all)
    svg(panels, a.svg or os.path.join(a.out, "memory_budget.svg"))
    print("| config | setting | budget MB | peak saved MB (× free) | median ms [range] | discards | recomputes | "
          "decisions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_all:
        if "infeasible_least" in r:
            print(f"| {r['config']} | budget @ {r['at']} | {r['budget'] / 1e6:.1f} | infeasible: least "
                  f"{r['infeasible_least'] / 1e6:.1f} MB | — | — | — | — |")
            continue
        at = f"budget @ {r['at']}" if r["policy"] == "budget" else (
            f"plan @ {r['at']}" if r["policy"] == "budget+plan" else r["policy"])
        budget = f"{r['budget'] / 1e6:.1f}" if r["policy"].startswith("budget") and r["budget"] else "—"
        print(f"| {r['config']} | {at} | {budget} | {r['saved_peak'] / 1e6:.1f} ({r['saved_peak'] / r['free_peak']:.2f}) | "
              f"{r['median_ms']:.1f} [{min(r['ms']):.1f}–{max(r['ms']):.1f}] | {r['discards']} | {r['recomputes']} | "
              f"{r['decisions']} |")


if __name__ == "__main__":
    main()
