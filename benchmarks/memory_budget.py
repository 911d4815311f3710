#!/usr/bin/python3
"""Step time against a hard memory budget (remat::MemoryBudget) for the GPT `small` and `deep`
configurations and the U-Net-like model, next to hand-placed checkpointing at the same memory.
Runs bench_memory_budget once per model (settings alternate within each of its rounds), writes the
rows as CSV, the curves as SVG, and prints a table; then, for each hand-placed policy, the ratio of
the budget's planned step to the hand-placed step measured in back-to-back pairs (--pairs of them),
the comparison the Pareto claim rests on.
usage: memory_budget.py --bin BUILD/benchmarks --out DIR [--rounds 3] [--steps 2] [--pairs 15] [--svg PATH]"""
import argparse
import csv
import json
import os
import subprocess
import sys

from run import CONFIGS, pyplot, save_svg

UNET = dict(layers=6, width=512, context=128, batch=8, vocab=256, heads=4)
MODELS = [("small", "gpt", CONFIGS["small"], "blocks,sqrt,selective,uniform:2,binomial:4,budget:48"),
          ("deep", "gpt", CONFIGS["deep"], "blocks,sqrt,selective,uniform:2,binomial:4,budget:24"),
          ("unet", "unet", UNET, "levels,levels:2,levels:3")]


def run(binary, model, cfg, hand, rounds, steps, pairs):
    cmd = [binary, "--model", model, "--rounds", str(rounds), "--steps", str(steps), "--pairs", str(pairs)]
    for k, v in cfg.items():
        cmd += [f"--{k}", str(v)]
    if hand:
        cmd += ["--hand", hand]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"benchmark failed: {' '.join(cmd)}\n{res.stderr}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def plot(panels, path):
    """One panel per model: median step time against the peak of activation bytes saved (fraction of the
    no-checkpoint peak); lines for the budget (searched and planned), dots for hand placement."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), layout="constrained")
    for ax, (name, rows) in zip(axes, panels):
        ok = [(r["policy"], r["saved_peak"] / r["free_peak"], r["median_ms"]) for r in rows if "median_ms" in r]
        for pol, label in (("budget", "budget (searched)"), ("budget+plan", "budget (plan it settles on)")):
            ax.plot(*zip(*sorted((f, t) for p, f, t in ok if p == pol)), marker=".", label=label)
        hand = [(p, f, t) for p, f, t in ok if p not in ("none", "budget", "budget+plan", "budget+own")]
        ax.plot([f for _, f, _ in hand], [t for _, _, t in hand], "o", color="tab:red", label="hand-placed")
        for p, f, t in hand:
            ax.annotate(p, (f, t), xytext=(3, -3), textcoords="offset points", va="top", color="tab:red")
        ax.plot([f for p, f, _ in ok if p == "none"], [t for p, _, t in ok if p == "none"], "ok", label="no checkpointing")
        ax.set(title=name, xlim=(0, 1.05), ylim=(0, None), xlabel="peak activations saved / no-checkpoint peak",
               ylabel="ms per step (median)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("remat MemoryBudget: step time vs peak activation bytes saved (fraction of no checkpointing)")
    save_svg(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--svg", default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pyplot()  # the plot at the end needs matplotlib: fail now, before the runs, if it is missing
    binary = os.path.join(a.bin, "bench_memory_budget")
    panels, rows_all, pairs = [], [], []
    for name, model, cfg, hand in MODELS:
        rows = run(binary, model, cfg, hand, a.rounds, a.steps, a.pairs)
        for r in rows:
            r["config"] = name
        pairs += [r for r in rows if r["policy"] == "pair"]
        rows = [r for r in rows if r["policy"] != "pair"]
        panels.append((name, rows))
        rows_all += rows
    keys = ["config", "model", "policy", "at", "budget", "free_peak", "saved_peak", "median_ms", "discards",
            "recomputes", "recomputed_gflop", "decisions", "search_ms", "recost_ms", "infeasible_least", "ms"]
    with open(os.path.join(a.out, "memory_budget.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows_all)
    plot(panels, a.svg or os.path.join(a.out, "memory_budget.svg"))
    print("| config | setting | budget MB | peak activations saved MB (× free) | median ms [range] | discards | recomputes | "
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
    if not pairs:
        return
    with open(os.path.join(a.out, "memory_budget_pairs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["config", "at", "median_ratio", "hand_ms", "plan_ms", "ratios"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(pairs)
    print(f"\nplan / hand-placed at the hand-placed policy's peak, {a.pairs} back-to-back pairs each:")
    print("| config | hand-placed | median ratio [quartiles] (range) | hand ms | plan ms |")
    print("|---|---|---|---|---|")
    for r in pairs:
        q = sorted(r["ratios"])
        print(f"| {r['config']} | {r['at']} | {r['median_ratio']:.3f} [{q[len(q) // 4]:.3f}–{q[(3 * len(q)) // 4]:.3f}] "
              f"({q[0]:.3f}–{q[-1]:.3f}) | {r['hand_ms']:.1f} | {r['plan_ms']:.1f} |")


if __name__ == "__main__":
    main()
