"""`megatronapp diagnose` (diagnose.py) and `megatronapp resilience simulate|watch|store` (simulate.py, driver.py,
store.py)."""
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


def cmd_watch(args: argparse.Namespace) -> int:
    from megatronapp.resilience.driver import DriverOptions, watch

    if args.world < 1:
        raise ConfigError(f"--world {args.world}: must be >= 1 (the job's number of ranks)")
    for name in ("hang_timeout", "heartbeat_interval", "startup_timeout", "give_up_after"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be > 0 seconds")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: must be >= 0")
    result = watch(Path(args.heartbeat_dir), DriverOptions(
        world=args.world, hang_timeout_s=args.hang_timeout, max_restarts=args.max_restarts,
        heartbeat_s=args.heartbeat_interval, startup_timeout_s=args.startup_timeout,
        give_up_after_s=args.give_up_after))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    restarts = len(result["failures"])
    print(f"{'completed' if result['completed'] else 'not completed'} at step {result['steps']} in round "
          f"{result['round']}, {restarts} restart(s) decided")
    return 0 if result["completed"] else 1


def cmd_store(args: argparse.Namespace) -> int:
    from megatronapp.resilience.store import serve

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: must be a TCP port (1-65535)")
    serve(args.addr, args.port)
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
    p = sub.add_parser("resilience", help="resilience tools: effective-training-time simulation, the multi-host driver")
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
    w = rsub.add_parser("watch", help="drive a multi-host job: hang detection and attribution, restart decisions",
                        description="Watch the heartbeats of a job whose ranks torchrun started with "
                                    "`train --heartbeat-dir DIR`: name the rank a hang waits for (with the waits "
                                    "tree) or whose heartbeat stopped, and make every rank exit so that torchrun "
                                    "restarts the job from its newest intact checkpoint.")
    w.add_argument("--heartbeat-dir", required=True, help="the directory the ranks beat to (every host sees it)")
    w.add_argument("--world", type=int, required=True, help="the job's number of ranks (nnodes x nproc-per-node)")
    w.add_argument("--hang-timeout", type=float, metavar="S",
                   help="seconds without step progress that make a hang (default: 10x the slowest step, >= 30)")
    w.add_argument("--max-restarts", type=int, default=3, help="restart decisions before giving up (default 3)")
    w.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S",
                   help="the ranks' --heartbeat-interval (default 1)")
    w.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                   help="allowance before a round's first step (default 300)")
    w.add_argument("--give-up-after", type=float, metavar="S",
                   help="stop when no rank of the round has beaten for S seconds (default: wait)")
    w.add_argument("--json", help="also write the result here")
    w.set_defaults(func=cmd_watch)
    st = rsub.add_parser("store", help="host the c10d rendezvous store outside the training hosts",
                         description="Host torchrun's c10d rendezvous store on a machine that does not train, so "
                                     "that losing any training host (host 0 included) leaves the rendezvous "
                                     "intact. Every host then runs torchrun with --rdzv-endpoint ADDR:PORT and "
                                     "--rdzv-conf is_host=0.")
    st.add_argument("--addr", required=True, help="the address to listen on (one of this host's; never all)")
    st.add_argument("--port", type=int, default=29400)
    st.set_defaults(func=cmd_store)
