#!/usr/bin/python3
"""benchmarks/run.py believes the PyTorch peer's numbers only when its BLAS ran as a healthy one does:
a probe whose products collapsed (OpenBLAS's threads under contention) is retried, and a peer still
collapsed, or collapsed while the rounds ran, gets no ratio ("no result: <why>") and run.py exits
non-zero. Synthetic probe results and step times stand in for torch and the benchmark binaries, so
this runs without either (and never touches OPENBLAS_*: run.py's commands are not run)."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import run  # noqa: E402

HEALTHY = {"float32 1024^3": 178.6, "float32 256^3": 121.0, "bfloat16 1024^3": 150.2}
COLLAPSED = {"float32 1024^3": 178.6, "float32 256^3": 8.4, "bfloat16 1024^3": 150.2}  # issue 65's probe
PRESCOTT = {"float32 1024^3": 30.1, "float32 256^3": 24.0, "bfloat16 1024^3": 20.3}  # slow, not collapsed


def probe(rates):
    return {"gflops": dict(rates), "score": 1.0, "core": "SkylakeX"}


class Fake:
    """run.run_json's stand-in: the probe's results in turn (the last repeated; `after` once the peer
    has run), remat's step at `remat_ms`, the peer's at `torch_ms(n)` at its n-th run (from 0, in the
    order run.py runs them)."""

    def __init__(self, probes, remat_ms=250.0, torch_ms=lambda n: 500.0, after=None):
        self.probes, self.remat_ms, self.torch_ms, self.after = list(probes), remat_ms, torch_ms, after
        self.probe_calls = self.torch_calls = 0

    def __call__(self, cmd, env=None):
        if cmd[1:2] == ["-c"]:
            self.probe_calls += 1
            if self.after and self.torch_calls:
                return probe(self.after)
            return probe(self.probes.pop(0) if len(self.probes) > 1 else self.probes[0])
        if cmd[0].endswith("bench_gemm"):
            return {"gemm_gflops": 400.0, "eigen_gflops": 350.0, "backend": "oneDNN", "backend_gflops": 400.0}
        if cmd[0].endswith("bench_gpt_step"):
            return {"ms": [self.remat_ms] * 3, "saved_peak": 10**8}
        assert cmd[1].endswith("gpt_step_torch.py"), cmd
        ms = self.torch_ms(self.torch_calls)
        self.torch_calls += 1
        return {"ms": [ms] * 3, "saved_peak": 10**8}


def run_main(fake, rounds=1):
    """run.py's main on the small configuration with `fake` for its commands: (stdout, exit status)."""
    out, status = io.StringIO(), 0
    saved = run.run_json, sys.argv, getattr(run, "PROBE_PAUSE_S", None)
    with tempfile.TemporaryDirectory() as tmp:
        run.run_json, run.PROBE_PAUSE_S = fake, 0
        sys.argv = ["run.py", "--bin", tmp, "--out", tmp, "--rounds", str(rounds), "--steps", "3",
                    "--configs", "small", "--sweep", "0"]
        try:
            with contextlib.redirect_stdout(out):
                run.main()
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
            print(e.code, file=out)
        finally:
            run.run_json, sys.argv, run.PROBE_PAUSE_S = saved
    return out.getvalue(), status


def table_rows(text, config="small", mode="none", precision="fp32"):
    return [line for line in text.splitlines() if line.startswith(f"| {config} | {mode} | {precision} |")]


class ProbeJudgement(unittest.TestCase):
    def test_small_products_far_below_large_ones_are_a_collapse(self):
        why = run.probe_collapse(COLLAPSED)
        self.assertIsNotNone(why)
        self.assertIn("8.4", why)
        self.assertIn("178.6", why)

    def test_a_product_below_the_floor_is_a_collapse(self):
        why = run.probe_collapse({"float32 1024^3": 9.0, "float32 256^3": 7.5, "bfloat16 1024^3": 150.0})
        self.assertIsNotNone(why)
        self.assertIn("9.0", why)

    def test_healthy_and_merely_slow_probes_are_believed(self):
        self.assertIsNone(run.probe_collapse(HEALTHY))
        self.assertIsNone(run.probe_collapse(PRESCOTT))  # a slow peer is the candidates' business
        at_the_line = 178.6 * run.PROBE_SMALL_OVER_LARGE
        self.assertIsNone(run.probe_collapse({"float32 1024^3": 178.6, "float32 256^3": at_the_line, "bfloat16 1024^3": 150.2}))


class RunRefusesACollapsedPeer(unittest.TestCase):
    def test_a_peer_collapsed_at_every_attempt_gets_no_ratio(self):
        # Issue 65: the probe at 8.4 against 178.6, then PyTorch's small step at 2,309 ms, printed as
        # remat/PyTorch 0.11.
        fake = Fake([COLLAPSED], remat_ms=254.0, torch_ms=lambda n: 2309.0)
        text, status = run_main(fake)
        self.assertNotEqual(status, 0, text)
        for line in table_rows(text):
            self.assertNotIn("0.11", line)
            self.assertIn("no result", line)
        self.assertIn("8.4", text)  # says why
        self.assertEqual(fake.torch_calls, 0)  # and does not spend the rounds on a peer it will not believe
        self.assertGreaterEqual(fake.probe_calls, run.PROBE_ATTEMPTS)  # each candidate retried

    def test_a_collapse_that_passes_is_retried_and_believed(self):
        fake = Fake([COLLAPSED, HEALTHY], torch_ms=lambda n: 500.0)
        text, status = run_main(fake)
        self.assertEqual(status, 0, text)
        self.assertIn("0.50", table_rows(text)[0])

    def test_a_healthy_peer_gets_its_ratio(self):
        text, status = run_main(Fake([HEALTHY], torch_ms=lambda n: 500.0))
        self.assertEqual(status, 0, text)
        self.assertIn("| 0.50, 0.50 |", table_rows(text)[0])
        self.assertNotIn("no result", text)

    def test_a_peer_step_far_below_its_probe_gets_no_ratio(self):
        # A healthy probe, then the peer's float32 step at 2,309 ms: 42.3 GFLOP in it, 18 GFLOP/s
        # against the probe's 178.6 — the products collapsed while the rounds ran.
        text, status = run_main(Fake([HEALTHY], remat_ms=254.0, torch_ms=lambda n: 2309.0))
        self.assertNotEqual(status, 0, text)
        for precision in ("fp32", "bf16"):  # the bf16 step against the probe's bfloat16 product
            self.assertNotIn("0.11", table_rows(text, precision=precision)[0])
            self.assertIn("no result", table_rows(text, precision=precision)[0])

    def test_one_round_far_slower_than_the_others_gets_no_ratio(self):
        # 3 rounds, 3 peer modes x 2 precisions a round (bf16 first in odd rounds): the peer's fp32 "none" of
        # round 2, its 8th run, at 10x.
        text, status = run_main(Fake([HEALTHY], torch_ms=lambda n: 5000.0 if n == 7 else 500.0), rounds=3)
        self.assertNotEqual(status, 0, text)
        self.assertIn("no result", table_rows(text)[0])
        self.assertIn("| 0.50, 0.50 |", table_rows(text, mode="blocks")[0])  # the others stand

    def test_a_probe_collapsed_after_the_rounds_gets_no_ratio(self):
        text, status = run_main(Fake([HEALTHY], torch_ms=lambda n: 500.0, after=COLLAPSED))
        self.assertNotEqual(status, 0, text)
        self.assertIn("no result", table_rows(text)[0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
