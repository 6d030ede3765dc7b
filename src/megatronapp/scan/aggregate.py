"""Merge per-rank trace files into one Chrome Trace Event Format timeline (Perfetto, chrome://tracing).

One process per rank, named "DP{d}-PP{p}-TP{t} (rank r)" and sorted by pipeline stage, then data-parallel
replica, then tensor rank, so a pipeline reads top to bottom. Each rank has a "compute" and a "comm" thread.
Clocks are aligned to rank 0 (align.py) before merging. Flow arrows join each send to its recv, and point
from the member that arrived last at a collective (the one the others waited for) to every other member.

At scale the whole job is more than a viewer opens (Perfetto's UI holds a few hundred MB): `ranks` writes a chosen
set, and `only_flagged` the ranks `detect` names plus their peers (`with_peers`), still aligned on every rank's
clock anchors.
"""
from __future__ import annotations

import functools
import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import numpy as np

from megatronapp.scan.detect.align import estimate_offsets, to_reference
from megatronapp.scan.read.format import CATS, RankTrace, read_rank
from megatronapp.scan.read.traces import read_traces

TID_COMPUTE, TID_COMM = 0, 1
_COMM = CATS.index("comm")
_EPS_US = 0.0005  # flow endpoints sit just inside their slice so viewers bind them to it


def process_label(t: RankTrace) -> str:
    """The timeline's name for a rank: the one its header gives (a MegaFBD rank names its role), else its
    coordinates."""
    if t.header.get("process_name"):
        return str(t.header["process_name"])
    dp, pp, tp = t.coord
    return f"DP{dp}-PP{pp}-TP{tp} (rank {t.rank})"


class _EventWriter:
    """Streams `{"traceEvents": [...]}` so a large merge never holds every event as a Python object."""

    def __init__(self, f: IO[str], batch: int = 4096):
        self.f, self.n = f, 0
        # One encoder for every event (json.dumps with options builds a new one per call), and events written
        # in batches: millions of events at scale. allow_nan=False: NaN/Infinity are not JSON, and a viewer
        # would reject the whole file for one of them.
        self._encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
        self._buf: list[str] = []
        self._batch = batch
        f.write('{"displayTimeUnit": "ms", "traceEvents": [\n')

    def add(self, ev: dict) -> None:
        self._buf.append(self._encode(ev))
        self.n += 1
        if len(self._buf) >= self._batch:
            self._write()

    def _write(self) -> None:
        if self._buf:
            self.f.write((",\n" if self.n > len(self._buf) else "") + ",\n".join(self._buf))
            self._buf = []

    def finish(self, other: dict) -> None:
        self._write()
        self.f.write('\n], "otherData": ' + json.dumps(other, default=str) + "}\n")


def _us(ns: float | np.ndarray) -> Any:
    return np.round(np.asarray(ns, dtype=np.float64) / 1000.0, 3)


def parse_ranks(text: str) -> list[int]:
    """"3,7,100-131" -> the ranks it names (`scan aggregate --ranks`)."""
    out: list[int] = []
    for part in text.split(","):
        try:
            a, _, b = part.strip().partition("-")
            out += range(int(a), int(b or a) + 1)
        except ValueError:
            raise ValueError(f"--ranks {text!r}: expected comma-separated ranks or ranges like 3,7,100-131") \
                from None
    return out


def with_peers(flagged: Iterable[int], traces: list[RankTrace]) -> list[int]:
    """The flagged ranks plus the peers that show why: TP peers (same stage and replica), the neighbouring stages
    of the same column, and the DP ring neighbours (previous and next replica, wrapping)."""
    by_coord = {tuple(t.coord): t.rank for t in traces}
    topo = {t.rank: t.topo for t in traces}
    coord = {t.rank: tuple(t.coord) for t in traces}
    out: set[int] = set()
    for r in flagged:
        r = int(r)
        out.add(r)
        if r not in coord:
            continue
        (d, p, t), (ntp, _, ndp) = coord[r], topo[r]
        near = [(d, p, x) for x in range(ntp)] + [(d, p - 1, t), (d, p + 1, t)] + \
            [((d - 1) % max(ndp, 1), p, t), ((d + 1) % max(ndp, 1), p, t)]
        out.update(by_coord[c] for c in near if c in by_coord)
    return sorted(out)


def flagged_ranks(traces: list[RankTrace], offsets: dict[int, int] | None = None,
                  group_limit: int = 8) -> tuple[list[int], list[str]]:
    """(ranks to write, finding labels): what `detect` names on these traces, with `with_peers`. A finding naming
    more than `group_limit` ranks (a whole slow group) adds its members only, or the peers would be most of the job."""
    from megatronapp.scan.detect.analysis import detect

    findings = detect(traces, offsets).findings
    return _with_peers_of(findings, traces, group_limit), [f.describe() for f in findings]


def _with_peers_of(findings: list, traces: list, group_limit: int) -> list[int]:
    """The ranks findings name plus with_peers of those in findings of at most `group_limit` ranks."""
    small = [r for f in findings if len(f.ranks) <= group_limit for r in f.ranks]
    large = [r for f in findings if len(f.ranks) > group_limit for r in f.ranks]
    return sorted(set(with_peers(small, traces)) | {int(r) for r in large})


def flagged_two_level(trace_dir: str | Path, group_limit: int = 8, use_summaries: bool = True
                      ) -> tuple[list[RankTrace], list[str], str, list[str], list[int]]:
    """flagged_ranks for a job too large for one table (triage.analyse_two_level): (the traces of the ranks to write,
    finding labels, what the triage read, problems, every rank that has a file). Only the written ranks' files are
    read in full."""
    from megatronapp.scan.detect.triage import analyse_two_level

    an, problems, feats = analyse_two_level(trace_dir, with_features=True, use_summaries=use_summaries)
    present = [int(r) for r in np.flatnonzero(feats.coords[:, 0] >= 0)]
    stubs = [SimpleNamespace(rank=r, coord=tuple(feats.coords[r]), topo=feats.topo) for r in present]
    findings = an.report.findings
    chosen = _with_peers_of(findings, stubs, group_limit)
    shared: dict = {}
    traces = [read_rank(feats.paths[r], shared) for r in chosen if r in feats.paths]
    return traces, [f.describe() for f in findings], an.report.notes[0], problems, present


def aggregate(trace_dir: str | Path, out_path: str | Path, offsets: dict[int, int] | None = None,
              flows: bool = True, ranks: Iterable[int] | None = None, only_flagged: bool = False,
              two_level: bool = False, use_summaries: bool = True) -> dict:
    """Merge a trace directory into Chrome trace JSON (gzip if `out_path` ends in .gz); return a report.

    `offsets` (ns per rank, relative to rank 0) overrides the estimate from the traces' own anchors. `ranks`
    writes only those ranks; `only_flagged` only the ranks detect names plus their peers (with_peers) and, when
    nothing is found, no rank at all (the report says so). Flow arrows are kept between written ranks.
    `two_level` (with only_flagged): detect by triage (triage.py) and read only the written ranks in full; their
    clocks are then aligned among themselves (a job too large to hold: 100,096 ranks); `use_summaries` as
    features.features'."""
    if two_level and only_flagged and ranks is None:
        traces, labels, note, problems, present = flagged_two_level(trace_dir, use_summaries=use_summaries)
        report: dict[str, Any] = {"out": str(out_path), "ranks": present, "problems": problems, "findings": labels,
                                  "two_level": note,
                                  "clocks": "aligned among the written ranks (two-level: the others were not read)"}
        keep: set[int] | None = {t.rank for t in traces}
    else:
        traces, problems = read_traces(trace_dir)
        report = {"out": str(out_path), "ranks": [t.rank for t in traces], "problems": problems}
        keep = None
    if ranks is not None:
        keep = {int(r) for r in ranks}
        unknown = sorted(keep - set(report["ranks"]))
        if unknown:
            raise ValueError(f"--ranks names ranks with no readable trace: {unknown[:20]}")
    if only_flagged and "findings" not in report:
        chosen, labels = flagged_ranks(traces, offsets)
        keep = set(chosen) if keep is None else keep | set(chosen)
        report["findings"] = labels
    align_report: dict | None = None
    if offsets is None:
        offsets, residual, align_report = estimate_offsets(traces)
        report.update(residual_ns=residual, unaligned=align_report["unaligned"])
    report["offsets_ns"] = {t.rank: int(offsets.get(t.rank, 0)) for t in traces}
    starts = [int(np.min(to_reference(t.rank, t.ts, offsets, align_report))) for t in traces if len(t)]
    origin = min(starts) if starts else 0
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Level 6, not gzip's default 9: at millions of events 9 costs more time for a few % of size.
    opener = functools.partial(gzip.open, compresslevel=6) if out.suffix == ".gz" else open
    shown = traces if keep is None else [t for t in traces if t.rank in keep]
    if keep is not None:
        report["written_ranks"] = [t.rank for t in shown]
    with opener(out, "wt", encoding="utf-8") as f:
        w = _EventWriter(f)
        order = sorted(shown, key=lambda t: (t.coord[1], t.coord[0], t.coord[2], t.rank))
        for idx, t in enumerate(order):
            w.add({"ph": "M", "name": "process_name", "pid": t.rank, "args": {"name": process_label(t)}})
            w.add({"ph": "M", "name": "process_sort_index", "pid": t.rank, "args": {"sort_index": idx}})
            for tid, label in ((TID_COMPUTE, "compute"), (TID_COMM, "comm")):
                w.add({"ph": "M", "name": "thread_name", "pid": t.rank, "tid": tid, "args": {"name": label}})
        sends: dict[tuple[int, int, int], tuple[int, float]] = {}
        recvs: dict[tuple[int, int, int], tuple[int, float]] = {}
        colls: dict[tuple, list[tuple[int, float, float]]] = {}
        for t in shown:
            start = _us(to_reference(t.rank, t.ts, offsets, align_report) - origin)
            end = _us(to_reference(t.rank, t.ts + t.dur, offsets, align_report) - origin)
            _emit_rank(w, t, start, end, sends, recvs, colls)
        nflows = _emit_flows(w, sends, recvs, colls) if flows else 0
        report.update(events=w.n, flows=nflows)
        w.finish({"megascan": {k: report[k] for k in ("ranks", "offsets_ns", "problems")}})
    return report


def _emit_rank(w: _EventWriter, t: RankTrace, start: np.ndarray, end: np.ndarray, sends: dict, recvs: dict,
               colls: dict) -> None:
    names, groups = t.names, t.groups
    cols = [c.tolist() for c in (t.name, t.cat, t.it, t.gid, t.seq, t.peer, t.nbytes, t.chunk, t.mb)]
    ts_l, end_l = start.tolist(), end.tolist()
    for k, (ni, ci, it, gid, seq, peer, nb, chunk, mb) in enumerate(zip(*cols)):
        args: dict[str, Any] = {"it": it}
        if mb >= 0:
            args["mb"] = mb
        if chunk >= 0:
            args["chunk"] = chunk
        is_comm = ci == _COMM
        if gid >= 0:
            gname, granks = groups[gid]
            args.update(group=gname, seq=seq, bytes=nb)
            if peer >= 0:
                args["peer"] = peer
                if names[ni] == "send":
                    sends[(t.rank, peer, seq)] = (t.rank, ts_l[k], end_l[k])
                elif names[ni] == "recv":
                    recvs[(peer, t.rank, seq)] = (t.rank, ts_l[k], end_l[k])
            elif seq >= 0:
                colls.setdefault((gname, granks, seq), []).append((t.rank, ts_l[k], end_l[k]))
        w.add({"ph": "X", "name": names[ni], "cat": CATS[ci] if 0 <= ci < len(CATS) else "other", "pid": t.rank,
               "tid": TID_COMM if is_comm else TID_COMPUTE, "ts": ts_l[k], "dur": round(end_l[k] - ts_l[k], 3),
               "args": args})


def _flow(w: _EventWriter, fid: int, src: tuple, dst: tuple, name: str) -> None:
    """One arrow from the start of slice `src` to the end of slice `dst` ((pid, start_us, end_us) each)."""
    s_ts = src[1] + min(_EPS_US, (src[2] - src[1]) / 2)
    f_ts = dst[2] - min(_EPS_US, (dst[2] - dst[1]) / 2)
    w.add({"ph": "s", "id": fid, "name": name, "cat": "flow", "pid": src[0], "tid": TID_COMM, "ts": s_ts})
    w.add({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": "flow", "pid": dst[0], "tid": TID_COMM,
           "ts": f_ts})


def _emit_flows(w: _EventWriter, sends: dict, recvs: dict, colls: dict) -> int:
    fid = 0
    for key, src in sends.items():
        dst = recvs.get(key)
        if dst is not None:
            fid += 1
            _flow(w, fid, src, dst, "p2p")
    for (gname, _, _), members in colls.items():
        if len(members) < 2:
            continue
        last = max(members, key=lambda m: m[1])  # arrived last: the member the others waited for
        for m in members:
            if m is not last:
                fid += 1
                _flow(w, fid, last, m, gname)
    return fid
