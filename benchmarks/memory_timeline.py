#!/usr/bin/python3
"""Bytes saved for backward over one training step of the example GPT, one line per policy: runs
train_gpt with --trace for each, reads the traces' saved-bytes counter track and draws them on one
time axis as an SVG (with matplotlib: Debian's python3-matplotlib).

    /usr/bin/python3 benchmarks/memory_timeline.py --train-gpt build/release/examples/train_gpt \
        --out benchmarks/memory_timeline.svg [--policies none,blocks,sqrt,binomial:2] [--layers 8]
"""
import argparse
import json
import os
import subprocess
import tempfile

from run import pyplot, save_svg


def saved_over_time(trace_path):
    """(ms since the trace started, saved MiB) at every change of the books, and the step's spans."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    points = [(e["ts"] / 1000.0, e["args"]["saved bytes"] / 2**20) for e in events if e["ph"] == "C"]
    replays = sum(1 for e in events if e["ph"] == "B" and e["cat"] == "replay")
    return points, replays


def plot(lines, path, title):
    """One step line per policy (the books hold a value until the next change), labelled with its
    peak and its replays."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.2), layout="constrained")
    for name, (pts, replays) in lines.items():
        ax.step(*zip(*pts), where="post", linewidth=1.2,
                label=f"{name}: peak {max(v for _, v in pts):.1f} MiB, {replays} replays")
    ax.set(title=title, xlabel="time in the step (ms): forward, then backward with its replays",
           ylabel="MiB saved for backward", ylim=(0, None))
    ax.margins(x=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend()
    save_svg(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default="none,blocks,sqrt,binomial:2")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    pyplot()  # the plot at the end needs matplotlib: fail now, before the runs, if it is missing
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
    plot(lines, a.out, f"remat: bytes saved for backward over one step of the example GPT ({a.layers} layers)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
