#!/usr/bin/env python3
"""Early stop on and off, alternating in one run: ms per training step of the benchmark GPT
(small and deep configurations of run.py) under checkpointing per block and sqrt segments, with
the op outputs and GFLOP early stop skipped per step. Prints medians with ranges.
usage: early_stop.py --bin BUILD/benchmarks [--rounds 5] [--steps 3]"""
import argparse
import os
import statistics

from run import CONFIGS, flags, run_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    exe = os.path.join(a.bin, "bench_gpt_step")
    print(f"{'config':6} {'mode':6} {'early stop':10} {'ms/step median [min, max]':28} {'skipped ops':>11} {'skipped GFLOP':>13}")
    for name, cfg in CONFIGS.items():
        for mode in ("blocks", "sqrt"):
            samples = {"1": [], "0": []}
            skipped = {}
            for _ in range(a.rounds):
                for es in ("1", "0"):
                    r = run_json([exe] + flags(cfg, mode, a.steps) + ["--early-stop", es])
                    samples[es] += r["ms"]
                    skipped[es] = (r["early_stop_ops"], r["early_stop_gflop"])
            med = {es: statistics.median(v) for es, v in samples.items()}
            for es in ("0", "1"):
                v = samples[es]
                print(f"{name:6} {mode:6} {'on' if es == '1' else 'off':10} "
                      f"{med[es]:8.1f} [{min(v):.1f}, {max(v):.1f}]{'':8} {skipped[es][0]:11.0f} {skipped[es][1]:13.3f}")
            print(f"{'':6} {mode:6} change {100 * (med['1'] / med['0'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
