"""Read a trace directory whatever it holds: MegaScan rank files (`rank*.mst`) or PyTorch profiler traces.

Either way the analysis sizes per-(rank, iteration) arrays by the world the files claim times their iterations:
a trace claiming more than `format.MAX_CELLS` of them is skipped and named here, before anything is allocated,
and traces that only together claim more are refused as a whole (they are not of one job).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megatronapp.scan.read.format import CAT_INDEX, FILE_PATTERN, RankTrace, cells_problem, rank_file, read_dir
from megatronapp.scan.read.kineto import kineto_files, read_kineto_dir

_STEP = CAT_INDEX["step"]


def read_traces(path: str | Path) -> tuple[list[RankTrace], list[str]]:
    """Rank traces and problems of a directory: rank*.mst files where there are any, else Kineto JSON traces."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory {d} does not exist")
    if any(FILE_PATTERN.search(f.name) for f in d.iterdir()) or not kineto_files(d):
        traces, problems = read_dir(d)
    else:
        traces, problems = read_kineto_dir(d)
    return _within_cells(traces, problems)


def _within_cells(traces: list[RankTrace], problems: list[str]) -> tuple[list[RankTrace], list[str]]:
    """The traces an analysis can hold: each within MAX_CELLS (others skipped and named), and all together."""
    kept, iters = [], []
    for t in traces:
        steps = np.unique(t.it[t.cat == _STEP])
        too_big = cells_problem(t.world, len(steps))
        if too_big:
            files = t.header.get("files") or [rank_file(".", t.rank).name]
            problems.append(f"rank {t.rank} ({', '.join(map(str, files))}): {too_big}; skipped")
            continue
        kept.append(t)
        iters.append(steps)
    if kept:
        too_big = cells_problem(max(t.world for t in kept), len(np.unique(np.concatenate(iters))))
        if too_big:
            problems.append(f"the traces together claim {too_big}: not one job's; nothing read")
            return [], problems
    return kept, problems
