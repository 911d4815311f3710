#!/usr/bin/python3
"""remat against PyTorch on the same GPT configurations and checkpointing modes, in one run,
alternating the two per round; then the chain sweep and its plot. Writes CSV and SVG to --out and
prints the tables. PyTorch gets its best: 2 threads, and the OpenBLAS environment a probe finds fastest
for it (peer_blas_env: OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset, unless OpenBLAS's own detection then
falls back to a generic core), in its command alone; remat runs in the untouched environment.
Each GPT cell runs in both precisions, like for like: fp32, and bf16 (remat::autocast around
remat's forward, torch.autocast("cpu", dtype=torch.bfloat16) around the peer's; backward outside
both), the two precisions adjacent in every round and their order swapped from round to round.
The peer's numbers are believed only when its BLAS ran as a healthy one does (probe_collapse,
peer_step_doubt): a probe whose products collapsed is retried, and a peer still collapsed, or whose
steps collapsed while the rounds ran, gets "no result: <why>" in place of its time and no ratio, and
run.py exits non-zero after printing the tables.
usage: run.py --bin BUILD/benchmarks --out DIR [--rounds 3] [--steps 3] [--configs small,deep] [--sweep 1]"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "small": dict(layers=8, width=256, heads=4, context=128, batch=8, vocab=256),
    "deep": dict(layers=32, width=128, heads=4, context=64, batch=4, vocab=256),
}
MODES = ["none", "blocks", "sqrt", "selective", "binomial:2"]
PEER_MODES = ["none", "blocks", "sqrt"]  # selective and binomial: remat only (no PyTorch 1.13 equivalent)
PRECISIONS = ["fp32", "bf16"]
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


PEER_BLAS_PROBE = """
import ctypes, json, math, statistics, time, torch
torch.set_num_threads(2)
rates = {}
for dtype, n in ((torch.float32, 1024), (torch.float32, 256), (torch.bfloat16, 1024)):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(3):
        a @ b
    s = []
    for _ in range(9):
        t0 = time.perf_counter()
        a @ b
        s.append(time.perf_counter() - t0)
    rates[f"{str(dtype)[6:]} {n}^3"] = round(2 * n**3 / statistics.median(s) / 1e9, 1)
try:
    blas = ctypes.CDLL("libblas.so.3")
    blas.openblas_get_corename.restype = ctypes.c_char_p
    core = blas.openblas_get_corename().decode()
except (OSError, AttributeError):  # not OpenBLAS: the candidates then differ by noise alone
    core = "unknown"
score = math.exp(sum(math.log(r) for r in rates.values()) / len(rates))
print(json.dumps({"gflops": rates, "score": score, "core": core}))
"""


# When the peer's probe is believed. OpenBLAS's threads under contention (another process on the
# cores) wait at their barriers for a scheduler slice, and a product of a few milliseconds loses
# most of its time to that while a large one hides it: on a loaded machine the probe ran float32
# 256^3 at 8.4 GFLOP/s against 178.6 at 1024^3 (issue 65), and 2.8 against 48.8 here beside two
# compilers, where another probe of that hour ran 256^3 at 120.7 (and 1024^3, healthy, runs at
# 165-210): 256^3 fills 2 threads less well, but not 20x less. The peer's steps are made of products
# of that size, so its step then ran 2,309 ms and remat/PyTorch printed 0.11: a false win by 5x.
PROBE_SMALL_OVER_LARGE = 0.25  # float32 256^3 under a quarter of 1024^3's rate: collapsed (the two above: 0.05)
PROBE_FLOOR_GFLOPS = 10.0  # a float32 product under it: collapsed. The slowest kernels the peer was seen
# on, OpenBLAS's generic Prescott ones, ran 1024^3 at ~30 on 2 threads: slow, but a peer, not a collapse
PROBE_ATTEMPTS = 3  # probes of a candidate before it is judged collapsed
PROBE_PAUSE_S = 5.0  # between them: a burst of contention (a link, a test) often passes in seconds
# While the rounds run: the peer's step did 0.4-1.1x its probe's 1024^3 rate of the same precision
# in model FLOPs per second in the README's runs (float32: small none 200.8 and 366.2 ms, deep blocks
# 130.6; bfloat16 under autocast: small none 224.8, blocks 339.5 ms; blocks and sqrt recompute a
# forward the count leaves out), the collapsed one 0.10x. A round whose median is over
# ROUND_SLOWDOWN times its other rounds' is one too.
PEER_STEP_MIN_FRACTION = 0.2
PROBE_OF = {"fp32": "float32 1024^3", "bf16": "bfloat16 1024^3"}  # the probe's product a step is held to
ROUND_SLOWDOWN = 2.0


def probe_collapse(gflops):
    """Why the probe's rates ({"float32 1024^3": GFLOP/s, "float32 256^3": ..., ...}) show a collapsed
    BLAS, or None when they do not: the small float32 product far below the large one, or a float32
    product below the floor. A slow BLAS whose products are alike (a generic core) is not collapsed:
    choosing among the candidates is for that. bfloat16 has no floor (a CPU without bfloat16
    instructions runs it slowly, healthily)."""
    small, large = gflops.get("float32 256^3"), gflops.get("float32 1024^3")
    if small is not None and large and small < PROBE_SMALL_OVER_LARGE * large:
        return (f"float32 256^3 at {small} GFLOP/s against {large} at 1024^3, under {PROBE_SMALL_OVER_LARGE} of it "
                "(BLAS threads contended)")
    low = {k: v for k, v in gflops.items() if k.startswith("float32") and v < PROBE_FLOOR_GFLOPS}
    if low:
        return ", ".join(f"{k} at {v} GFLOP/s" for k, v in low.items()) + f", under the floor of {PROBE_FLOOR_GFLOPS}"
    return None


def peer_step_doubt(round_ms, step_gflops, probe_gflops, precision):
    """Why one cell of the peer's steps (each round's median ms; model GFLOP/s over the cell's median
    step) cannot be believed, or None: a round far slower than the others, or a step far below the
    rate its probe's 1024^3 product of that precision ran at (its products collapsed while it was
    timed)."""
    for i, ms in enumerate(round_ms):
        others = round_ms[:i] + round_ms[i + 1:]
        if others and ms > ROUND_SLOWDOWN * statistics.median(others):
            return (f"round {i + 1}'s median step {ms:.1f} ms is {ms / statistics.median(others):.1f}x the other "
                    f"rounds' {statistics.median(others):.1f}")
    rate = probe_gflops.get(PROBE_OF[precision])
    if rate and step_gflops < PEER_STEP_MIN_FRACTION * rate:
        return (f"its step ran {step_gflops:.1f} GFLOP/s of model products, under {PEER_STEP_MIN_FRACTION} of its "
                f"probe's {PROBE_OF[precision]} {rate}")
    return None


def probe_peer(label, env):
    """The probe under `env`, retried while it shows a collapse: (its result, why it collapsed or None)."""
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        r = run_json([PYTHON, "-c", PEER_BLAS_PROBE], env)
        rates = ", ".join(f"{k} {v}" for k, v in r["gflops"].items())
        why = probe_collapse(r["gflops"])
        print(f"  peer BLAS, {label}: OpenBLAS core {r['core']}, torch products GFLOP/s: {rates}" +
              (f" — collapsed ({why}), attempt {attempt} of {PROBE_ATTEMPTS}" if why else ""))
        if why is None:
            return r, None
        if attempt < PROBE_ATTEMPTS:
            time.sleep(PROBE_PAUSE_S)
    return r, why


def peer_blas_env():
    """The peer's environment, its best by measurement: (env, the probe's result, why the peer cannot
    be believed or None). The machine's OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE
    slow OpenBLAS, so they are unset; but OpenBLAS 0.3.21's own detection takes some CPUs it does not
    know (this machine's Emerald Rapids, family 6 model 207) for a generic Prescott, whose kernels run
    a 1024^3 product at ~30 GFLOP/s against ~165-210 with the AVX-512 ones: a false win for remat.
    So torch's products (float32 1024^3 and 256^3, bfloat16 1024^3) are timed under each candidate
    (unset, the machine's own values, then each AVX-512 or AVX2 core OpenBLAS has), and the best
    geometric mean of their GFLOP/s among the probes that did not collapse is the peer's, printed
    with the rest. When every candidate's probe collapsed PROBE_ATTEMPTS times, there is no peer."""
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    candidates = [("unset", base)]
    if any(k in os.environ for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        candidates.append(("the machine's", dict(os.environ)))
    for core in ("Cooperlake", "SkylakeX", "Haswell"):
        candidates.append((f"OPENBLAS_CORETYPE={core}", dict(base, OPENBLAS_CORETYPE=core)))
    best, why = None, None
    for label, env in candidates:
        r, collapsed = probe_peer(label, env)
        if collapsed:
            why = why or f"{label}: {collapsed}"
        elif best is None or r["score"] > best[2]["score"]:
            best = (label, env, r)
    if best is None:
        why = f"the peer's BLAS collapsed in every probe, {PROBE_ATTEMPTS} under each environment ({why})"
        print(f"  {why}: the peer is not run, and no ratio printed\n")
        return None, None, why
    print(f"  the peer runs with {best[0]} (core {best[2]['core']})\n")
    return best[1], best[2], None


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


def refuse(refusals):
    """Ends the run with a failure when a ratio was refused, so that no reader (or script) takes the
    tables for a clean comparison."""
    if refusals:
        sys.exit("run.py: remat/PyTorch ratios not printed, since the peer's numbers cannot be believed:\n  " +
                 "\n  ".join(refusals))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="GPT configurations, comma-separated")
    ap.add_argument("--sweep", type=int, default=1, choices=[0, 1], help="0: the GPT tables only, no chain sweep")
    a = ap.parse_args()
    unknown = [c for c in a.configs.split(",") if c not in CONFIGS]
    if unknown:
        sys.exit(f"run.py: unknown --configs {','.join(unknown)} (there are {', '.join(CONFIGS)})")
    os.makedirs(a.out, exist_ok=True)
    if a.sweep:
        pyplot()  # the plot at the end needs matplotlib: fail now, before the runs, if it is missing
    peer_env, peer_probe, peer_refused = peer_blas_env()

    g = run_json([os.path.join(a.bin, "bench_gemm")])
    gemm = g["gemm_gflops"]
    print(f"float32 GEMM 1024^3 on 2 threads: Eigen {g['eigen_gflops']:.1f} GFLOP/s, "
          f"{g['backend']} (the build's backend) {g['backend_gflops']:.1f} GFLOP/s; fractions below are of "
          f"the better, {gemm:.1f}\n")

    configs = {name: CONFIGS[name] for name in a.configs.split(",")}
    rows = []
    for name, cfg in configs.items():
        samples = {}
        for rnd in range(a.rounds):
            for mode in MODES:
                # Both precisions side by side, fp32 first in even rounds and bf16 first in odd ones.
                for precision in PRECISIONS if rnd % 2 == 0 else PRECISIONS[::-1]:
                    # remat with the explicit attention (as the peer computes it), then with its fused op.
                    for attention, impl in (("explicit", "remat"), ("fused", "remat-fused")):
                        r = run_json([os.path.join(a.bin, "bench_gpt_step")] + flags(cfg, mode, a.steps) +
                                     ["--attention", attention, "--precision", precision])
                        samples.setdefault((impl, precision, mode), []).append(r)
                    if mode in PEER_MODES and not peer_refused:
                        t = run_json([PYTHON, os.path.join(HERE, "gpt_step_torch.py")] + flags(cfg, mode, a.steps) +
                                     ["--precision", precision], peer_env)
                        samples.setdefault(("torch", precision, mode), []).append(t)
        for (impl, precision, mode), rs in samples.items():
            ms = [x for r in rs for x in r["ms"]]
            med = statistics.median(ms)
            gflops = 3 * forward_flops(cfg) / (med / 1e3) / 1e9
            doubt = None
            if impl == "torch":
                doubt = peer_step_doubt([statistics.median(r["ms"]) for r in rs], gflops, peer_probe["gflops"],
                                        precision)
            rows.append(dict(config=name, impl=impl, precision=precision, mode=mode, ms_median=round(med, 1),
                             ms_min=round(min(ms), 1), ms_max=round(max(ms), 1), samples=len(ms),
                             saved_peak=max(r["saved_peak"] for r in rs), model_gflops=round(gflops, 1),
                             gemm_fraction=round(gflops / gemm, 3), doubt=doubt or ""))
    if peer_env is not None:  # the products again, now that the rounds are over: did they collapse meanwhile?
        _, after = probe_peer("after the rounds", peer_env)
        if after:
            peer_refused = f"the peer's BLAS collapsed after the rounds ({after})"
    refusals = ([peer_refused] if peer_refused else []) + \
        [f"{r['config']} {r['mode']} {r['precision']}: {r['doubt']}" for r in rows if r["doubt"]]
    for why in refusals:
        print(f"  no remat/PyTorch ratio: {why}")
    with open(os.path.join(a.out, "gpt_step.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    def find(config, impl, precision, mode):
        return next((r for r in rows if (r["config"], r["impl"], r["precision"], r["mode"]) == (config, impl, precision, mode)),
                    None)

    def cell(r):
        return f"{r['ms_median']} ({r['ms_min']}-{r['ms_max']})" if r else "—"

    def peer(config, precision, mode):
        """The peer's row of a cell, or why it has none that can be believed."""
        if mode not in PEER_MODES:
            return None, None
        if peer_refused:
            return None, "the peer's BLAS collapsed"
        t = find(config, "torch", precision, mode)
        return (None, f"its steps collapsed ({t['doubt']})") if t and t["doubt"] else (t, None)

    def mb(r):
        return f"{r['saved_peak'] / 1e6:.1f}" if r else "—"

    print("ms/step (median, min-max). bf16 = forward under autocast (remat::autocast; the peer's torch.autocast "
          "cpu bfloat16), backward outside; GFLOP/s are model FLOPs over the step, as a fraction of the best "
          "float32 GEMM.\n")
    print("| config | mode | precision | remat, explicit attention | remat, fused attention | PyTorch | "
          "remat/PyTorch explicit, fused | remat × none explicit, fused | bf16 speed-up remat explicit, fused, PyTorch | "
          "remat GFLOP/s explicit, fused (fraction of best GEMM) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in configs:
        for mode in MODES:
            for precision in PRECISIONS:
                r, f = (find(name, impl, precision, mode) for impl in ("remat", "remat-fused"))
                t, no_result = peer(name, precision, mode)
                base, base_f = find(name, "remat", precision, "none"), find(name, "remat-fused", precision, "none")
                ratio = f"{r['ms_median'] / t['ms_median']:.2f}, {f['ms_median'] / t['ms_median']:.2f}" if t else \
                    ("no ratio" if no_result else "—")
                if precision == "fp32":
                    speedup = "—"
                else:  # fp32 time over bf16 time, per implementation
                    olds = [find(name, impl, "fp32", mode) for impl in ("remat", "remat-fused")] + \
                        [peer(name, "fp32", mode)[0]]
                    speedup = ", ".join(f"{o['ms_median'] / n['ms_median']:.2f}" if o and n else "—"
                                        for o, n in zip(olds, (r, f, t)))
                peer_cell = f"no result: {no_result}" if no_result else cell(t)
                print(f"| {name} | {mode} | {precision} | {cell(r)} | {cell(f)} | {peer_cell} | {ratio} | "
                      f"{r['ms_median'] / base['ms_median']:.2f}, {f['ms_median'] / base_f['ms_median']:.2f} | {speedup} | "
                      f"{r['model_gflops']} ({r['gemm_fraction']:.0%}), {f['model_gflops']} ({f['gemm_fraction']:.0%}) |")

    print("\npeak bytes saved for backward, MB (remat: its allocator's books; PyTorch: saved-tensor hooks, each storage "
          "once)\n")
    print("| config | mode | remat explicit fp32 | remat explicit bf16 | remat fused fp32 | remat fused bf16 | "
          "PyTorch fp32 | PyTorch bf16 | bf16/fp32 remat explicit, fused, PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in configs:
        for mode in MODES:
            cells = [find(name, impl, precision, mode) for impl in ("remat", "remat-fused", "torch") for precision in PRECISIONS]
            fractions = ", ".join(f"{n['saved_peak'] / o['saved_peak']:.2f}" if o and n else "—"
                                  for o, n in zip(cells[0::2], cells[1::2]))
            print(f"| {name} | {mode} | " + " | ".join(mb(c) for c in cells) + f" | {fractions} |")

    if not a.sweep:
        print(f"\nwrote {a.out}/gpt_step.csv (no chain sweep: --sweep 0)")
        return refuse(refusals)
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
    refuse(refusals)


if __name__ == "__main__":
    main()
