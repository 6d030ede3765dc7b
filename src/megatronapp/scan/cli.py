"""`megatronapp scan ...`: aggregate, detect, heatmap, simulate, summary."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megatronapp.scan.read.traces import read_traces


def _small_pages() -> None:
    """Ask numpy not to madvise its big arrays into transparent huge pages, unless NUMPY_MADVISE_HUGEPAGE says.

    A scan allocates gigabytes of short-lived columns; where THP is in `madvise` mode with `defrag=madvise` (as on
    the project's machine) each huge-page fault may compact memory first. `scan detect` on 12,288 rank files spent
    6-8 s of system time with huge pages and 3.7-4.9 s without, at the same user time and reports (speed only)."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # numpy >= 2
    except ImportError:
        try:
            from numpy.core.multiarray import _set_madvise_hugepage  # numpy 1.x
        except ImportError:
            return
    _set_madvise_hugepage(False)


def _reuse_freed_memory() -> None:
    """Keep arrays under 1 GB on glibc's heap, and the heap's freed memory in the process, unless a MALLOC_*
    variable says otherwise (glibc reads those at start-up).

    By default glibc maps every block over its mmap threshold (at most 32 MB) afresh and unmaps it on free, so each
    of detect's many big short-lived temporaries (8 million rows at 12,288 ranks) is paid again in page faults:
    `scan detect` on 12,288 rank files spent 5-7 s of its 18-24 s in system time. From the heap, a freed block is
    reused by the next one (calloc then zeroes in user time what the kernel zeroed before, so part of the saving
    moves there). Measured side by side (2026-12-03, load ~1, runs alternated): 16.9 s wall (15.7-15.9 s user,
    1.4-1.7 s system), peak 1,458 MB, against 17.7-20.6 s (13.5-15.7 s user, 4.6-5.2 s system), 1,453 MB; reports
    byte-identical. A `scan` command is a short process: memory it keeps is returned at exit."""
    if any(k.startswith("MALLOC_") for k in os.environ) or not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    mallopt(m_mmap_threshold, 1 << 30)
    mallopt(m_trim_threshold, (1 << 31) - 1)  # mallopt takes a C int: 2 GB, the most it can say


def _tune_memory() -> None:
    """What every reading `scan` command does first: small pages, freed memory reused."""
    _small_pages()
    _reuse_freed_memory()


def _load(trace_dir: str, align: bool):
    """Read a trace directory (problems to stderr) and optionally estimate clock offsets."""
    _tune_memory()
    try:
        traces, problems = read_traces(trace_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"scan: {e}") from None
    for p in problems:
        print(f"scan: {p}", file=sys.stderr)
    if not traces:
        raise SystemExit(f"scan: no readable rank traces in {trace_dir}")
    offsets = clock = None
    if align:
        from megatronapp.scan.detect.align import estimate_offsets

        offsets, residual, clock = estimate_offsets(traces)  # clock: per-rank drift too, used with the offsets
        print(f"scan: clocks aligned, median residual {residual / 1e3:.1f} us", file=sys.stderr)
    return traces, offsets, clock


def cmd_aggregate(args: argparse.Namespace) -> int:
    from megatronapp.scan.aggregate import aggregate, parse_ranks

    _tune_memory()
    try:
        report = aggregate(args.dir, args.out, ranks=parse_ranks(args.ranks) if args.ranks else None,
                           only_flagged=args.only_flagged, two_level=args.only_flagged and _two_level(args),
                           use_summaries=not args.no_summaries)
    except ValueError as e:
        print(f"scan aggregate: {e}", file=sys.stderr)
        return 2
    if "written_ranks" in report and not args.json:
        found = "; ".join(report.get("findings", [])) or ("nothing found" if args.only_flagged else "")
        print(f"scan aggregate: wrote {len(report['written_ranks'])} of {len(report['ranks'])} ranks"
              + (f" ({found})" if found else ""), file=sys.stderr)
    print(json.dumps(report, indent=1, default=str) if args.json else f"wrote {args.out}")
    return 0


def _no_summaries(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-summaries", action="store_true",
                   help="two-level: work every rank's triage numbers out from its spans, not from the summary block "
                        "its writer left at the end of its file (slower; for files whose summaries you doubt)")


def _two_level(args: argparse.Namespace) -> bool:
    """Whether `detect` triages first: asked for, or (auto) more spans than one table holds in memory."""
    if args.two_level != "auto":
        return args.two_level == "on"
    from megatronapp.scan.detect.triage import LARGE_SPANS, estimated_spans

    try:
        return estimated_spans(args.dir) > LARGE_SPANS
    except OSError:
        return False  # _load names the problem


def cmd_detect(args: argparse.Namespace) -> int:
    from megatronapp.scan.detect.analysis import detect

    if _two_level(args):
        an, _ = _two_level_analysis(args)
        print(an.report.to_json() if args.json else an.report.to_text())
        return 1 if (args.fail_on_finding and an.report.findings) else 0
    traces, offsets, clock = _load(args.dir, args.align)
    report = detect(traces, offsets, clock=clock, release_traces=True)
    print(report.to_json() if args.json else report.to_text())
    return 1 if (args.fail_on_finding and report.findings) else 0


def _two_level_analysis(args: argparse.Namespace):
    """Triage, then the full detector on what it chose (triage.analyse_two_level); its problems on stderr.
    Returns (analysis, the triage's Features of every rank)."""
    from megatronapp.scan.detect.triage import analyse_two_level

    _tune_memory()
    try:
        an, problems, feats = analyse_two_level(args.dir, align=args.align, with_features=True,
                                                use_summaries=not args.no_summaries)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"scan: {e}") from None
    for p in problems:
        print(f"scan: {p}", file=sys.stderr)
    return an, feats


def _analysis(args: argparse.Namespace, command: str):
    """The analysis `heatmap` and `summary` show: of every rank, or (two-level) of the ranks the triage chose, with
    the others left out and a line on stderr saying so."""
    from megatronapp.scan.detect.analysis import analyse

    if _two_level(args):
        an, feats = _two_level_analysis(args)
        shown = "only the ranks analysed in full are shown" if command == "summary" else \
            "every rank's triage numbers are drawn, the waits of the ranks analysed in full"
        print(f"scan {command}: {an.report.notes[0].split(':')[0]}: {shown} ({int(an.table.present.sum())} of "
              f"{len(an.table.present)} read in full)", file=sys.stderr)
        return an, feats
    traces, offsets, clock = _load(args.dir, args.align)
    return analyse(traces, offsets, clock=clock, release_traces=True), None


def cmd_heatmap(args: argparse.Namespace) -> int:
    from megatronapp.scan import heatmap

    an, feats = _analysis(args, "heatmap")
    try:
        out = heatmap.write(an, args.out, feats)
    except ValueError as e:
        print(f"scan heatmap: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from megatronapp.scan.summary import summary_table

    an, _ = _analysis(args, "summary")
    print(summary_table(an, limit=None if args.all else args.limit))
    print()
    print(an.report.to_text())
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from megatronapp.scan.synth.simulate import simulate

    _tune_memory()  # its big per-stage temporaries too: page faults were a third of its system time at 100,096 ranks
    try:
        res = simulate(args.out, args.ranks, args.tp, args.pp, args.dp, args.iterations, args.fault or [],
                       args.seed, args.microbatches)
    except ValueError as e:
        print(f"scan simulate: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only directory: say where, not a traceback from a writer thread
        print(f"scan simulate: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    faults = "; ".join(f.label() for f in res.faults) or "none"
    print(f"wrote {res.world} rank files ({res.spans} spans) to {res.out_dir}: tp={res.tp} pp={res.pp} "
          f"dp={res.dp}, {res.iterations} iterations x {res.microbatches} microbatches; faults: {faults}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `scan` command and its sub-commands to the main CLI."""
    scan = subparsers.add_parser("scan", help="MegaScan: merge traces, find slow ranks and links, simulate",
                                 description="MegaScan trace tools. A trace directory holds rank*.mst files, or "
                                             "PyTorch profiler (Kineto) traces: *.json[.gz] with distributedInfo.")
    sub = scan.add_subparsers(dest="scan_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("aggregate", help="merge rank files into one Perfetto/Chrome trace with aligned clocks")
    p.add_argument("dir")
    p.add_argument("-o", "--out", required=True, help="output .json or .json.gz")
    p.add_argument("--json", action="store_true", help="print the aggregation report as JSON")
    p.add_argument("--ranks", default=None, metavar="LIST",
                   help="write only these ranks, e.g. 3,7,100-131 (clocks still aligned on every rank)")
    p.add_argument("--only-flagged", action="store_true",
                   help="write only the ranks `scan detect` names plus their TP peers, neighbouring stages and DP "
                        "ring neighbours: a file Perfetto can open at thousands of ranks")
    p.add_argument("--two-level", choices=("auto", "on", "off"), default="auto",
                   help="with --only-flagged: detect by triage and read only the written ranks in full, their clocks "
                        "aligned among themselves (auto: past about 50 million spans)")
    _no_summaries(p)
    p.set_defaults(func=cmd_aggregate)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("dir", help="trace directory (rank*.mst, or PyTorch profiler *.json[.gz])")
        p.add_argument("--align", action="store_true",
                       help="estimate clock offsets first and use aligned start times (default: skew-free "
                            "duration-based analysis)")
        _no_summaries(p)

    p = sub.add_parser("detect", help="name the ranks and links that slow the job down (root cause, not victims)")
    common(p)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--fail-on-finding", action="store_true", help="exit 1 when anything is found (for CI)")
    p.add_argument("--two-level", choices=("auto", "on", "off"), default="auto",
                   help="triage every rank cheaply, then analyse the suspects, their groups and reference pipelines "
                        "in full (auto: past about 50 million spans, counted from file sizes)")
    p.set_defaults(func=cmd_detect)

    p = sub.add_parser("heatmap", help="rank-grid heat-map as .png or interactive .html")
    common(p)
    p.add_argument("-o", "--out", required=True, help="heat.png or heat.html")
    p.add_argument("--two-level", choices=("auto", "on", "off"), default="auto",
                   help="as detect's: past about 50 million spans, every rank's triage numbers are drawn (own work "
                        "and host time) and the waits of the ranks analysed in full; rows binned past 1,200")
    p.set_defaults(func=cmd_heatmap)

    p = sub.add_parser("summary", help="per-rank table of compute / comm / wait time and the findings")
    common(p)
    p.add_argument("--limit", type=int, default=40, help="rows to show for large jobs (flagged ranks first)")
    p.add_argument("--all", action="store_true", help="show every rank")
    p.add_argument("--two-level", choices=("auto", "on", "off"), default="auto",
                   help="as detect's: past about 50 million spans, only the ranks analysed in full are listed")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("simulate", help="write synthetic traces of a large 3D-parallel job with injected faults")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, default=None, help="default: ranks / (tp*pp)")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=None, help="default: pp (at least 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", action="append", metavar="SPEC",
                   help="slow-compute=RANK:FACTOR | slow-link=A-B[:FACTOR] | pause=RANK:MS[:EVERY] | "
                        "late-arrival=RANK:MS (repeatable)")
    p.add_argument("-o", "--out", required=True, type=Path, help="output trace directory")
    p.set_defaults(func=cmd_simulate)
