"""Read a trace directory whatever it holds: MegaScan rank files (`rank*.mst`) or PyTorch profiler traces."""
from __future__ import annotations

from pathlib import Path

from megatronapp.scan.read.format import FILE_PATTERN, RankTrace, read_dir
from megatronapp.scan.read.kineto import kineto_files, read_kineto_dir
from megatronapp.scan.read.kineto_layout import pipeline_layout


def read_traces(path: str | Path) -> tuple[list[RankTrace], list[str]]:
    """Rank traces and problems of a directory: rank*.mst files where there are any, else Kineto JSON traces (their
    pipeline layout read from their point-to-point transfers, where they name their peers)."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory {d} does not exist")
    if any(FILE_PATTERN.search(f.name) for f in d.iterdir()) or not kineto_files(d):
        return read_dir(d)
    traces, problems = read_kineto_dir(d)
    traces, more = pipeline_layout(traces)
    return traces, problems + more
