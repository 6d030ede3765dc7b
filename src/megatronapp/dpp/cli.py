"""`megatronapp dpp ...`: simulate and compare pipeline schedules; draw a real trace's schedule."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatronapp.dpp.simulator import SCHEDULE_NAMES, SimConfig, SimResult, compare

DEFAULT_COMPARE = "1f1b,interleaved-1f1b,zb-h1,dpp-dfs,dpp-bfs,dpp-adaptive,dpp-zb"


def _schedules(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEDULE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--compare: unknown schedule(s) {unknown}; choose from "
                                         f"{', '.join(SCHEDULE_NAMES)}")
    return names


def format_table(results: list[SimResult], reference: str | None = None) -> str:
    """A comparison table: step time, ratio to `reference` (or the first), bubble, peak activations."""
    ref = next((r for r in results if r.schedule == reference), results[0])
    lines = [f"{'schedule':<18}{'step':>12}{'vs ' + ref.schedule:>26}{'bubble':>9}{'peak act.':>11}{'peak tasks':>12}"]
    for r in results:
        lines.append(f"{r.schedule:<18}{r.step_time:>12.4g}{r.step_time / ref.step_time:>26.3f}"
                     f"{100 * r.bubble:>8.1f}%{max(r.peak_activation):>11.3g}{max(r.peak_inflight):>12d}")
    lines.append("peak act.: activations held on the busiest stage, in whole-stage units (a chunk is 1/vpp); "
                 "peak tasks: in chunk activations")
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    cfg = SimConfig(pp=args.pp, vpp=args.vpp, microbatches=args.microbatches, fwd=args.fwd, bwd=args.bwd,
                    latency=args.latency, bandwidth=args.bandwidth, act_bytes=args.act_bytes,
                    compute_jitter=args.compute_jitter or args.jitter, link_jitter=args.link_jitter or args.jitter,
                    seed=args.seed, max_inflight=args.max_inflight, w_fraction=args.w_fraction,
                    stage_factors=_stage_factors(args.slow_stage, args.pp))
    try:
        results = compare(args.compare, cfg, timeline=bool(args.output))
    except ValueError as e:
        print(f"dpp simulate: {e}", file=sys.stderr)
        return 2
    ref = "interleaved-1f1b" if "interleaved-1f1b" in args.compare else None
    if args.json:
        print(json.dumps({"config": cfg.__dict__, "results": [r.to_dict() for r in results]}, indent=1,
                         default=list))
    else:
        print(f"pp={cfg.pp} vpp={cfg.vpp} microbatches={cfg.microbatches} fwd={cfg.fwd} bwd={cfg.bwd} "
              f"latency={cfg.latency} compute jitter={cfg.compute_jitter} link jitter={cfg.link_jitter} "
              f"cap={cfg.max_inflight}")
        print(format_table(results, ref))
    if args.output:
        from megatronapp.dpp.plot import Timeline, save

        print(f"wrote {save([Timeline.from_result(r) for r in results], args.output)}")
    return 0


def _stage_factors(spec: list[str] | None, pp: int) -> list[float] | None:
    """--slow-stage S:FACTOR (repeatable) into per-stage compute factors."""
    if not spec:
        return None
    factors = [1.0] * pp
    for item in spec:
        try:
            s, f = item.split(":")
            stage, factor = int(s), float(f)
        except ValueError:
            raise SystemExit(f"dpp simulate: --slow-stage {item!r}: use STAGE:FACTOR, e.g. 3:1.5") from None
        if not 0 <= stage < pp or factor <= 0:
            raise SystemExit(f"dpp simulate: --slow-stage {item!r}: stage must be in [0, {pp}) and factor > 0")
        factors[stage] = factor
    return factors


def cmd_plot(args: argparse.Namespace) -> int:
    from megatronapp.dpp.plot import save, timeline_from_trace

    try:
        timeline, problems = timeline_from_trace(args.trace_dir, args.iteration)
    except (FileNotFoundError, ValueError) as e:
        print(f"dpp plot: {e}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"dpp plot: {p}", file=sys.stderr)
    print(f"wrote {save([timeline], args.output)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `dpp simulate` and `dpp plot` to the main CLI."""
    dpp = subparsers.add_parser("dpp", help="MegaDPP: simulate dynamic pipeline schedules, draw schedules",
                                description="Dynamic pipeline scheduling: compare schedules in a discrete-event "
                                            "simulation, or draw the schedule a traced run actually ran.")
    sub = dpp.add_subparsers(dest="dpp_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("simulate", help="simulate one step of several schedules and print a comparison table")
    p.add_argument("--pp", type=int, default=8, help="pipeline stages")
    p.add_argument("--vpp", type=int, default=2, help="chunks per stage (1f1b and zb-h1 run merged chunks)")
    p.add_argument("--microbatches", "-m", type=int, default=32)
    p.add_argument("--fwd", type=float, default=1.0, help="forward time of one chunk for one microbatch")
    p.add_argument("--bwd", type=float, default=2.0, help="backward time of one chunk for one microbatch")
    p.add_argument("--latency", type=float, default=0.0, help="per-message link latency (same unit as --fwd)")
    p.add_argument("--bandwidth", type=float, default=None, help="link bandwidth, bytes per time unit")
    p.add_argument("--act-bytes", type=float, default=0.0, help="bytes of one activation message")
    p.add_argument("--jitter", default="none",
                   help="compute and link jitter: none | lognormal:SIGMA | uniform:A | spike:P:FACTOR")
    p.add_argument("--compute-jitter", default=None, help="overrides --jitter for compute")
    p.add_argument("--link-jitter", default=None, help="overrides --jitter for links")
    p.add_argument("--slow-stage", action="append", metavar="STAGE:FACTOR", help="a persistently slow stage")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="cap on activations a stage holds (dynamic policies), like parallel.dpp_max_inflight")
    p.add_argument("--w-fraction", type=float, default=0.5, help="ZB-H1: share of backward for weight grads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", type=_schedules, default=_schedules(DEFAULT_COMPARE),
                   help=f"comma-separated schedules (default {DEFAULT_COMPARE}); known: {', '.join(SCHEDULE_NAMES)}")
    p.add_argument("-o", "--output", default=None, help="also draw the timelines (.png, or .html)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("plot", help="draw the pipeline schedule of a MegaScan trace directory")
    p.add_argument("trace_dir", type=Path)
    p.add_argument("-o", "--output", required=True, help="output .png or .html")
    p.add_argument("--iteration", type=int, default=None, help="traced iteration (default: the last complete)")
    p.set_defaults(func=cmd_plot)
