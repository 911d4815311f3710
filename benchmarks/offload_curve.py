#!/usr/bin/python3
"""Step time against the RAM a step adds at its peak, for the small GPT: hand-placed checkpointing,
MemoryBudget alone, offload to disk alone, a budget with an offload inside it, and a budget that
chooses disk or recomputation per tensor by their costs (BudgetOffload) — one plot.
Runs bench_offload --curve 1 (settings alternate within each round, medians over rounds), writes
the rows as CSV, the plot as SVG, and prints a table.
usage: offload_curve.py --bin BUILD/benchmarks --out DIR [--rounds 5] [--dir /var/tmp] [--svg PATH]"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

from run import pyplot, save_svg

KINDS = [("hand", "hand-placed (in RAM)", "o", "tab:red"), ("budget", "MemoryBudget", "s-", "tab:blue"),
         ("offload", "offload alone", "^", "tab:green"), ("budget+offload", "budget + offload ≥ 4 MiB", "D-", "tab:purple"),
         ("budget+disk", "budget, disk or recompute by cost", "v-", "tab:orange")]


def plot(rows, disk, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.6), layout="constrained")
    for kind, label, style, color in KINDS:
        pts = sorted((r["peak"] / 1e6, r["median_ms"], r["setting"]) for r in rows if r["kind"] == kind)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
        for x, y, name in pts:
            short = name.replace("budget ", "b ").replace(" + offload >= 4096 KiB", "").replace("offload >= ", "≥ ")
            short = short.replace(", disk or recompute", "")
            short = short.replace(", boundaries offloaded", " boundaries")
            ax.annotate(short, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=7, color=color)
    ax.set(xlim=(0, None), ylim=(0, None), xlabel="RAM the step adds at its peak (MB)", ylabel="ms per step (median)",
           title=f"small GPT (L 8, d 256, T 128, B 8): step time against RAM\n"
                 f"disk (O_DIRECT) write {min(disk['disk_write_gbs']):.2f}–{max(disk['disk_write_gbs']):.2f}, "
                 f"read {min(disk['disk_read_gbs']):.2f}–{max(disk['disk_read_gbs']):.2f} GB/s")
    ax.grid(alpha=0.3)
    ax.legend()
    save_svg(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--svg", default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pyplot()  # fail before the runs if matplotlib is missing
    cmd = [os.path.join(a.bin, "bench_offload"), "--curve", "1", "--rounds", str(a.rounds), "--dir", a.dir]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.exit(f"benchmark failed: {' '.join(cmd)}\n{res.stderr}")
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    disk, rows = lines[0], lines[1:]
    for r in rows:
        r["median_ms"] = statistics.median(r["ms"])
    keys = ["setting", "kind", "budget", "median_ms", "peak", "activation_peak", "store_peak", "written", "late", "reads",
            "discards", "to_disk", "infeasible", "bitwise", "ms"]
    with open(os.path.join(a.out, "offload_curve.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, disk, a.svg or os.path.join(a.out, "offload_curve.svg"))
    none = next(r for r in rows if r["setting"] == "none")
    print(f"disk: write {disk['disk_write_gbs']} GB/s, read {disk['disk_read_gbs']} GB/s (before, after)")
    print("| setting | step ms, median (range) | × none | RAM peak MB | activation books peak MB | store peak MB | "
          "written MB | late / reads | to disk / discards | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        over = " (over the cap)" if r["infeasible"] else ""
        print(f"| {r['setting']}{over} | {r['median_ms']:.1f} ({min(r['ms']):.1f}–{max(r['ms']):.1f}) | "
              f"{r['median_ms'] / none['median_ms']:.2f} | {r['peak'] / 1e6:.1f} | {r['activation_peak'] / 1e6:.1f} | "
              f"{r['store_peak'] / 1e6:.1f} | {r['written'] / 1e6:.1f} | {r['late']} / {r['reads']} | "
              f"{r['to_disk']} / {r['discards']} | {'yes' if r['bitwise'] else 'NO'} |")


if __name__ == "__main__":
    main()
