#!/usr/bin/python3
"""remat against PyTorch on the same GPT configurations and checkpointing modes, in one run,
alternating the two per round; then the chain sweep and its plot. Writes CSV and SVG to --out and
prints the tables. PyTorch gets its best: 2 threads, and OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset
in its command alone (they slow OpenBLAS on this machine); remat runs in the untouched environment.
usage: run.py --bin BUILD/benchmarks --out DIR [--rounds 3] [--steps 3]"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {
    "small": dict(layers=8, width=256, heads=4, context=128, batch=8, vocab=256),
    "deep": dict(layers=32, width=128, heads=4, context=64, batch=4, vocab=256),
}
MODES = ["none", "blocks", "sqrt", "selective"]  # selective: remat only (no PyTorch 1.13 equivalent)
HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def flags(cfg, mode, steps):
    out = [f"--mode", mode, "--steps", str(steps), "--warmup", "1"]
    for k, v in cfg.items():
        out += [f"--{k}", str(v)]
    return out


def run_json(cmd, env=None):
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        sys.exit(f"benchmark failed: {' '.join(cmd)}\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def forward_flops(c):
    """Matrix-product FLOPs of one forward: per layer 24·BT·d² (qkv, proj, MLP) + 4·B·T²·d
    (scores and their product with v), plus the LM head 2·BT·d·V."""
    bt = c["batch"] * c["context"]
    per_layer = 24 * bt * c["width"] ** 2 + 4 * c["batch"] * c["context"] ** 2 * c["width"]
    return c["layers"] * per_layer + 2 * bt * c["width"] * c["vocab"]


def pyplot():
    """matplotlib's pyplot with no display, its SVGs the same bytes for the same data (imported
    here, so that the scripts importing CONFIGS alone do not need matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "remat"
    import matplotlib.pyplot as plt
    return plt


def save_svg(fig, path):
    fig.savefig(path, format="svg", metadata={"Date": None})


def plot_memory_vs_L(rows, path):
    """Peak saved bytes against L, one line per policy, log-log."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for p in dict.fromkeys(r["policy"] for r in rows):  # in the sweep's order: none first
        ax.plot(*zip(*sorted((r["L"], r["saved_peak"] / 2**20) for r in rows if r["policy"] == p)), marker="o", label=p)
    Ls = sorted({r["L"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(Ls, [str(L) for L in Ls])
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
    ax.grid(alpha=0.3)
    ax.set(title="remat: peak bytes saved for backward vs GPT depth L", xlabel="L (blocks, log scale)",
           ylabel="MiB saved at peak (log scale)")
    ax.legend(title="policy")
    save_svg(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pyplot()  # the plot at the end needs matplotlib: fail now, before the runs, if it is missing
    peer_env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}

    g = run_json([os.path.join(a.bin, "bench_gemm")])
    gemm = g["gemm_gflops"]
    print(f"float32 GEMM 1024^3 on 2 threads: Eigen {g['eigen_gflops']:.1f} GFLOP/s, "
          f"{g['backend']} (the build's backend) {g['backend_gflops']:.1f} GFLOP/s; fractions below are of "
          f"the better, {gemm:.1f}\n")

    rows = []
    for name, cfg in CONFIGS.items():
        samples = {}
        for _ in range(a.rounds):
            for mode in MODES:
                # remat with the explicit attention (as the peer computes it), then with its fused op.
                for attention, impl in (("explicit", "remat"), ("fused", "remat-fused")):
                    r = run_json([os.path.join(a.bin, "bench_gpt_step")] + flags(cfg, mode, a.steps) +
                                 ["--attention", attention])
                    samples.setdefault((impl, mode), []).append(r)
                if mode != "selective":
                    t = run_json([PYTHON, os.path.join(HERE, "gpt_step_torch.py")] + flags(cfg, mode, a.steps), peer_env)
                    samples.setdefault(("torch", mode), []).append(t)
        for (impl, mode), rs in samples.items():
            ms = [x for r in rs for x in r["ms"]]
            med = statistics.median(ms)
            gflops = 3 * forward_flops(cfg) / (med / 1e3) / 1e9
            rows.append(dict(config=name, impl=impl, mode=mode, ms_median=round(med, 1), ms_min=round(min(ms), 1),
                             ms_max=round(max(ms), 1), samples=len(ms), saved_peak=max(r["saved_peak"] for r in rs),
                             model_gflops=round(gflops, 1), gemm_fraction=round(gflops / gemm, 3)))
    with open(os.path.join(a.out, "gpt_step.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    def find(config, impl, mode):
        return next((r for r in rows if (r["config"], r["impl"], r["mode"]) == (config, impl, mode)), None)

    print("| config | mode | remat ms/step, explicit attention (median, min-max) | remat, fused attention | "
          "PyTorch ms/step | remat/PyTorch explicit, fused | remat × none explicit, fused | remat saved peak MB "
          "explicit, fused | PyTorch saved peak MB | remat GFLOP/s explicit, fused (fraction of best GEMM) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        base, base_f = find(name, "remat", "none"), find(name, "remat-fused", "none")
        for mode in MODES:
            r, f, t = find(name, "remat", mode), find(name, "remat-fused", mode), find(name, "torch", mode)
            tt = f"{t['ms_median']} ({t['ms_min']}-{t['ms_max']})" if t else "—"
            ratio = f"{r['ms_median'] / t['ms_median']:.2f}, {f['ms_median'] / t['ms_median']:.2f}" if t else "—"
            tmb = f"{t['saved_peak'] / 1e6:.1f}" if t else "—"
            print(f"| {name} | {mode} | {r['ms_median']} ({r['ms_min']}-{r['ms_max']}) | "
                  f"{f['ms_median']} ({f['ms_min']}-{f['ms_max']}) | {tt} | {ratio} | "
                  f"{r['ms_median'] / base['ms_median']:.2f}, {f['ms_median'] / base_f['ms_median']:.2f} | "
                  f"{r['saved_peak'] / 1e6:.1f}, {f['saved_peak'] / 1e6:.1f} | {tmb} | "
                  f"{r['model_gflops']} ({r['gemm_fraction']:.0%}), {f['model_gflops']} ({f['gemm_fraction']:.0%}) |")

    sweep = subprocess.run([os.path.join(a.bin, "bench_chain_sweep")], capture_output=True, text=True, check=True)
    srows = [json.loads(line) for line in sweep.stdout.splitlines() if line.strip()]
    with open(os.path.join(a.out, "chain_sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["chain", "L", "policy", "saved_peak", "ms", "advances"])
        w.writeheader()
        for r in srows:
            w.writerow({k: r.get(k, "") for k in w.fieldnames})
    print("\nchain sweep (GPT d=64, T=64, B=4; RNN cell d=32): peak saved MB / ms per step")
    for r in srows:
        extra = f", {r['advances']} advances" if "advances" in r else ""
        print(f"  {r['chain']:4s} L={r['L']:<6d} {r['policy']:15s} {r['saved_peak'] / 1e6:9.2f} MB {r['ms']:10.1f} ms{extra}")
    plot_memory_vs_L([r for r in srows if r["chain"] == "gpt"], os.path.join(a.out, "memory_vs_L.svg"))
    print(f"\nwrote {a.out}/gpt_step.csv, chain_sweep.csv, memory_vs_L.svg")


if __name__ == "__main__":
    main()
