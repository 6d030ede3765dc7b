"""Detection and recovery time of a supervised job: a tp2 x pp2 run with `--inject hang=2:3` under
`megatronapp train --supervise`. Measures how long after the hang began it was detected (the hung rank's own
heartbeat clock), and the recovery time: failure detected -> every rank has finished a step again (stop, relaunch,
load the checkpoint, first step). Peers: MegaScale reports minutes-scale recovery at 10k GPUs; this is one machine.
The job runs twice, side by side in one invocation: restarting at once (`--no-diagnose-on-restart`), and with the
diagnostics on the job's 4 ranks before the restart (the default); the difference is what diagnosing costs.

    python -m benchmarks.bench_recovery [--hang-timeout 5]
    python -m benchmarks.bench_recovery --quick      (the restart-at-once drill only; writes nothing)
    python -m benchmarks.bench_recovery --emulated [--drills 10] [--restart-drills 4] [--stop-drills 10]
                                          [--hang-drills 10] [--seed 41]
        8 emulated ranks: in-place recovery (--spares 1) from kill -9, SIGSTOP and a hang at drawn ranks and steps,
        split in parts, beside restarting every rank (benchmarks/recovery_emulated.py); --quick: one of each
    python -m benchmarks.bench_recovery --emulated --ranks 4 8 16 [--drills 5]
        the in-place kill -9 drill at each world size, flat or not (benchmarks/recovery_scale.py)
    python -m benchmarks.bench_recovery --emulated --overhead [--pairs 5]
        the steady-state cost of the in-place machinery, paired (benchmarks/recovery_overhead.py)
    python -m benchmarks.bench_recovery --emulated --zero [--overhead] [--pairs 5] [--drills 3]
        ZeRO-1 with and without the buddy copy of the optimizer slices: kill drills, or the steady-state cost
        (benchmarks/recovery_zero.py)
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

RESULTS = harness.results_path("recovery")
FLAGS = ["--nproc", "4", "--tp", "2", "--pp", "2", "--steps", "8", "--save-interval", "2", "--layers", "2",
         "--hidden", "64", "--global-batch", "4", "--microbatches", "2", "--seq-len", "16", "--no-progress",
         "--peak-tflops", "1", "--supervise", "--inject", "hang=2:3", "--heartbeat-interval", "0.5"]


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "one drill (restart at once; --emulated: one kill); writes nothing")
    ap.add_argument("--hang-timeout", type=float, default=None,
                    help="seconds (default 5; with --emulated, the in-place hang drill's: 3)")
    ap.add_argument("--emulated", action="store_true", help="emulated devices, in place against restarting every "
                    "rank (benchmarks/recovery_emulated.py)")
    ap.add_argument("--drills", type=int, default=None, help="with --emulated: in-place kill -9 drills (default 10; "
                    "with --ranks, per size: 5)")
    ap.add_argument("--restart-drills", type=int, default=4, help="with --emulated: restart-the-world drills")
    ap.add_argument("--stop-drills", type=int, default=10, help="with --emulated: in-place SIGSTOP drills")
    ap.add_argument("--hang-drills", type=int, default=10, help="with --emulated: in-place hang drills")
    ap.add_argument("--seed", type=int, default=41, help="with --emulated: the draws of rank, step and delay")
    ap.add_argument("--ranks", type=int, nargs="+", help="with --emulated: world sizes to compare (4 8 16)")
    ap.add_argument("--overhead", action="store_true", help="with --emulated: the machinery's cost per step")
    ap.add_argument("--pairs", type=int, default=5, help="with --overhead: paired jobs")
    ap.add_argument("--zero", action="store_true", help="with --emulated: ZeRO-1 jobs with and without the buddy "
                    "copy of the optimizer slices (benchmarks/recovery_zero.py): kill drills, or with --overhead "
                    "the steady-state cost")
    args = ap.parse_args(argv)
    if args.emulated:
        _emulated(args)
        return
    args.hang_timeout = 5.0 if args.hang_timeout is None else args.hang_timeout
    clock = harness.Clock()
    plain = _run(args.hang_timeout, ["--no-diagnose-on-restart"])
    diagnosed = None if args.quick else _run(args.hang_timeout, [])
    for what, r in (("restart at once", plain), ("diagnose first", diagnosed)):
        if r is None:
            continue
        print(f"{what}: hang detected {r['detected_after_s']:.1f} s after it began (timeout {args.hang_timeout:g} s), "
              f"rank {r['named_rank']} named; training again {r['recovery_s']:.1f} s after detection (diagnostics "
              f"{r['diagnose_s']:.1f} s); job {r['job_wall_s']:.0f} s")
    machine = harness.machine(clock)
    print(f"load {machine['load_avg_at_end'][0]:.1f}")
    if diagnosed is None:
        return
    result = {"hang_timeout_s": args.hang_timeout, **plain,
              # what diagnosing costs is its own run time; the difference of the two recoveries is also kept, but
              # on this shared machine load swings between the two runs exceed it
              "with_diagnose": diagnosed, "diagnose_cost_s": diagnosed["diagnose_s"],
              "recovery_difference_s": diagnosed["recovery_s"] - plain["recovery_s"],
              "timestamp": clock.timestamp, "machine": machine}
    harness.write_result(result, RESULTS)
    print(f"wrote {harness.shown(RESULTS)}")


def _emulated(args) -> None:
    from benchmarks import recovery_emulated, recovery_overhead, recovery_scale

    write = not args.quick
    if args.zero:
        from benchmarks import recovery_zero

        recovery_zero.main(1 if args.quick else args.pairs if args.overhead else 0,
                           0 if args.overhead else 1 if args.quick else 3 if args.drills is None else args.drills,
                           args.seed, write=write)
    elif args.overhead:
        recovery_overhead.main(1 if args.quick else args.pairs, write=write)
    elif args.ranks:
        recovery_scale.main(args.ranks, 1 if args.quick else 5 if args.drills is None else args.drills, args.seed,
                           write=write)
    elif args.quick:
        recovery_emulated.main(1, 1, 1, 1, args.seed, args.hang_timeout or recovery_emulated.HANG_TIMEOUT_S,
                               write=False)
    else:
        recovery_emulated.main(10 if args.drills is None else args.drills, args.restart_drills, args.stop_drills,
                               args.hang_drills, args.seed,
                               args.hang_timeout or recovery_emulated.HANG_TIMEOUT_S)


def _run(hang_timeout: float, extra: list[str]) -> dict:
    """One supervised drill; its detection and recovery times."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        t0 = time.time()
        res = subprocess.run([sys.executable, "-m", "megatronapp", "train", *FLAGS, *extra, "--hang-timeout",
                              str(hang_timeout), "--out", str(out)], capture_output=True, text=True, check=True)
        wall = time.time() - t0
        events = [json.loads(line) for line in (out / "resilience.jsonl").read_text().splitlines()]
    hung_for = float(re.search(r"in phase 'step 4' for ([0-9.]+) s", res.stderr).group(1))
    diagnosis = next((e["diagnosis"] for e in events if e["event"] == "evicted"), None) or {}
    return {"detected_after_s": hung_for, "named_rank": next(e["rank"] for e in events if e["event"] == "failure"),
            "recovery_s": next(e["recovery_s"] for e in events if e["event"] == "recovered"),
            "diagnose_s": diagnosis.get("seconds", 0.0), "job_wall_s": wall}


if __name__ == "__main__":
    main()
