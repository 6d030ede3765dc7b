"""`make bench`: run every benchmark in its own process, one after another (they measure ratios in one run, so
they must not overlap on a small machine). Results go to benchmarks/results/*.json and docs/benchmarks.md.

    python -m benchmarks.run_all [--quick] [NAME ...]   (--quick: every listed run in its --quick mode, which writes
                                                         nothing; NAMEs: only the runs whose command contains one)

BENCHMARKS lists every module of benchmarks/ that has a main, each mode that writes a result of its own as its own
run (in an order where a docs section that quotes another result comes after it). Left out, and why:
  gpu_check                            a pass/fail check of the CUDA paths, not a benchmark; it needs a GPU
                                       (benchmarks/gpu_check.sh runs it there)
  gpu_check_ranks                      part of gpu_check; its main prints the plan of rank layouts it checks
  run_all                              this file
  hta_traces                           downloads the public GPU traces bench_scan_hta and the tests read: no measurement
  bench_scan_hta                       needs the network, which `make bench` does not assume: its peer HTA in its own
                                       .venv-hta (`make .venv-hta/.installed`, from the package registry) and the
                                       public traces (`python -m benchmarks.hta_traces`); run by hand after those two
  bench_multihost                      4 hosts as network namespaces: needs root, and its drills take ~20 min on
                                       2 cores; run by hand (`python -m benchmarks.bench_multihost`)
  bench_scan_scale --cli / --scale-100k  the CLI at 12,288 and at 100,096 ranks: about 3 GB of trace files a job and
                                       an hour or more on 2 cores; run by hand (SCAN_SCALE_DIR picks the disk)
  bench_scan_detect --record           re-records the stored traces under benchmarks/data: not a measurement
  bench_dpp_emulated --cli             the README-style CLI check, an addition to bench_dpp_emulated's stored result
Long runs that are listed (an hour or more here): bench_scan_real (29 scenarios x 5 repeats in fresh processes),
bench_lamb_batch (9 training runs), bench_ablation --emulated.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks import harness

BENCHMARKS: list[tuple[str, ...]] = [
    ("bench_engine",),
    ("bench_zero",),
    ("bench_tp_overlap",),
    ("bench_data_pipeline",),
    ("bench_ablation",),
    ("overlap_trace_emulated",),  # quoted by bench_ablation --emulated's section
    ("bench_ablation", "--emulated", "--overlap"),  # quoted by bench_ablation --emulated's section
    ("bench_ablation", "--emulated"),
    ("bench_lamb_batch",),
    ("bench_checkpoint_stall",),
    ("bench_checkpoint_stall", "--emulated"),
    ("bench_recovery",),
    ("bench_recovery", "--emulated"),
    ("bench_recovery", "--emulated", "--ranks", "4", "8", "16"),
    ("bench_recovery", "--emulated", "--overhead"),
    ("bench_recovery", "--emulated", "--zero"),
    ("bench_recovery", "--emulated", "--zero", "--overhead"),
    ("bench_spare_start",),
    ("bench_startup",),
    ("bench_startup_memory",),
    ("bench_dpp_sim",),
    ("bench_dpp_real",),
    ("bench_dpp_emulated",),
    ("bench_fbd",),
    ("bench_fbd", "--emulated"),
    ("bench_scan_overhead",),
    ("bench_tracing_cost",),
    ("bench_scan_detect",),
    ("bench_scan_detect", "--family", "real", "--recordings", "busy"),
    ("bench_scan_detect", "--family", "real", "--recordings", "quiet"),
    ("bench_scan_detect", "--family", "real", "--recordings", "full"),
    ("bench_scan_detect", "--family", "real", "--recordings", "loaded"),
    ("bench_scan_detect", "--family", "large"),
    ("bench_scan_scale",),
    ("bench_scan_real",),
    ("bench_scope",),
    ("bench_scope_training",),
]
EXCLUDED = {"gpu_check": "a pass/fail check of the CUDA paths, not a benchmark; needs a GPU",
            "gpu_check_ranks": "part of gpu_check; its main prints the rank layouts it checks",
            "run_all": "this file", "hta_traces": "downloads the public GPU traces; no measurement",
            "bench_scan_hta": "needs the network (HTA from the registry into .venv-hta, the public traces); by hand",
            "bench_multihost": "needs root (hosts are network namespaces) and ~20 min; run by hand"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="every run in its --quick mode (writes nothing)")
    ap.add_argument("only", nargs="*", help="run only the commands that contain one of these")
    args = ap.parse_args(argv)
    failed = []
    for module, *flags in BENCHMARKS:
        cmd = " ".join([module, *flags])
        if args.only and not any(o in cmd for o in args.only):
            continue
        print(f"\n### {cmd}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", f"benchmarks.{module}", *flags,
                                *(["--quick"] if args.quick else [])], cwd=harness.ROOT)
        print(f"### {cmd}: exit {code} in {time.perf_counter() - t0:.0f} s", flush=True)
        if code:
            failed.append(cmd)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
