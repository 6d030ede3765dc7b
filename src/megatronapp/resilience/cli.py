"""`megatronapp diagnose` (diagnose.py) and `megatronapp resilience simulate` (simulate.py)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatronapp.config import ConfigError


def cmd_simulate(args: argparse.Namespace) -> int:
    from megatronapp.resilience.simulate import Job, default_intervals, report, sweep

    for name in ("gpus", "days", "failure_rate", "restart_s", "stall_s"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be > 0")
    if args.detect_s < 0:
        raise ConfigError(f"--detect-s {args.detect_s}: must be >= 0")
    # the stall scales with the bytes a rank copies to host memory; measured bandwidth times the model's share
    stall = args.stall_s
    if args.state_gib is not None:
        stall = args.state_gib * 1024 / args.copy_mib_s
    job = Job(gpus=args.gpus, days=args.days, failures_per_gpu_hour=args.failure_rate, detect_s=args.detect_s,
              restart_s=args.restart_s, stall_s=stall)
    intervals = [m * 60.0 for m in args.interval_min] if args.interval_min else default_intervals(job)
    result = sweep(job, intervals, seeds=args.seeds)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from megatronapp import faults
    from megatronapp.resilience.diagnose import GROUP_KINDS, report, run

    tp, pp = args.tp or 1, args.pp or 1
    dp = args.dp or args.nproc // (tp * pp)
    if args.nproc < 2 or tp * pp * dp != args.nproc:
        raise ConfigError(f"--nproc {args.nproc} must be >= 2 and equal tp*pp*dp = {tp}*{pp}*{dp}")
    for spec in args.inject:
        faults.parse(spec)
    group = None
    if args.group:
        kind, _, at = args.group.partition(":")
        if kind not in GROUP_KINDS or (at and not at.isdigit()):
            raise ConfigError(f"--group {args.group!r}: expected KIND[:RANK] with KIND one of "
                              f"{', '.join(GROUP_KINDS)} (e.g. dp:5, the DP group holding rank 5)")
        group = (kind, int(at or 0))
        if group[1] >= args.nproc:
            raise ConfigError(f"--group {args.group!r}: rank {group[1]} is outside --nproc {args.nproc}")
    result = run(args.nproc, (tp, pp, dp), args.inject, group)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("diagnose", help="GEMM, memory, pairwise P2P and per-group all-reduce tests; outliers named",
                       description="Run real tests on local ranks and name outliers against the median of their "
                                   "peers (robust statistics, as MegaScan): per rank GEMM throughput and a memory "
                                   "check, per pair P2P latency and bandwidth, per group all-reduce time.")
    d.add_argument("--nproc", type=int, default=4)
    d.add_argument("--tp", type=int)
    d.add_argument("--pp", type=int)
    d.add_argument("--dp", type=int)
    d.add_argument("--inject", action="append", default=[],
                   help="make a rank or link bad: slow-compute=RANK:FACTOR, slow-link=A-B:MS (repeatable)")
    d.add_argument("--group", metavar="KIND[:RANK]",
                   help="test only the ring-neighbour links of one group (tp, pp, dp or world; the one holding "
                        "RANK, default 0) instead of every pair: confirms a slow link MegaScan found inside it")
    d.add_argument("--json", help="also write the results here")
    d.set_defaults(func=cmd_diagnose)
    p = sub.add_parser("resilience", help="resilience tools: effective-training-time simulation")
    rsub = p.add_subparsers(dest="resilience_command", metavar="COMMAND", required=True)
    s = rsub.add_parser("simulate", help="effective training time of a long job with failures and checkpoints",
                        description="Simulate a long job: Poisson failures over all GPUs, each losing the work "
                                    "since the last checkpoint plus detection and restart; each save stalling "
                                    "training. Reports the effective fraction per checkpoint interval, the best "
                                    "one, and Young/Daly's optimum as a check.")
    s.add_argument("--gpus", type=int, default=12288)
    s.add_argument("--days", type=float, default=14.0)
    s.add_argument("--failure-rate", type=float, default=2.0e-5, help="failures per GPU-hour (Llama 3: ~2e-5)")
    s.add_argument("--detect-s", type=float, default=30.0, help="failure -> detected (a hang: the hang timeout)")
    s.add_argument("--restart-s", type=float, default=300.0, help="detected -> training again")
    s.add_argument("--stall-s", type=float, default=0.5, help="training stall per checkpoint save")
    s.add_argument("--state-gib", type=float, help="checkpoint bytes per rank: stall = this / --copy-mib-s")
    s.add_argument("--copy-mib-s", type=float, default=2000.0,
                   help="host-copy bandwidth of stage 1 (MiB/s; measured: docs/benchmarks.md)")
    s.add_argument("--interval-min", type=float, nargs="*", help="checkpoint intervals to compare (minutes)")
    s.add_argument("--seeds", type=int, default=5, help="simulated runs averaged per interval")
    s.add_argument("--json", help="also write the result here")
    s.set_defaults(func=cmd_simulate)
