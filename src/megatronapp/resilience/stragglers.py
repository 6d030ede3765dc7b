"""Persistent stragglers: a MegaScan finding that names the same cause in N trace windows in a row.

A supervised run with `--trace` writes every rank's spans for the last `trace.iterations` iterations of every
`trace.interval` (one trace window each). The driver analyses each window once every rank has finished it
(`scan.detect` on that window's spans alone) and keeps, per finding (kind and ranks), how many windows in a row
named it. A slow machine slows every window; a burst of load on a shared host, a one-off pause, a noisy
neighbour for a minute do not repeat on the same rank, so asking for `windows` consecutive windows (default 3) is
what separates a straggler worth acting on from noise (MegaScale treats a machine the same way: evict on
repeated evidence, not one sample). Each finding is reported once, when its streak reaches `windows`.

Only findings whose slowdown is at least `min_factor` (default 1.10: the rank costs the job 10%) count. MegaScan
names smaller persistent differences too, and on a host shared by more ranks than cores one rank can lag its peers
by a few % in every window (measured: 1.06x compute on a healthy 4-rank run on 2 cores, in 3 windows of 3): real,
but no reason to stop and restart a job, which costs minutes.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from megatronapp.scan.read.format import CAT_INDEX, COLUMNS, RankTrace, read_dir


def window_range(k: int, interval: int, iterations: int) -> tuple[int, int]:
    """Iterations (first, last) of trace window `k` (the tracer traces the end of each interval)."""
    last = (k + 1) * interval - 1
    return max(k * interval, last - iterations + 1), last


def window_slice(traces: list[RankTrace], first: int, last: int) -> list[RankTrace]:
    """The traces restricted to iterations first..last (finished spans only)."""
    out = []
    for t in traces:
        keep = (t.it >= first) & (t.it <= last)
        out.append(dataclasses.replace(t, opened={}, **{c: getattr(t, c)[keep] for c in COLUMNS}))
    return out


@dataclasses.dataclass
class Straggler:
    kind: str
    ranks: tuple[int, ...]
    windows: list[int]  # the consecutive windows that named it
    describe: str  # MegaScan's one-line description from the last of them


class StragglerWatch:
    """Analyse finished trace windows of one attempt and report findings that persist over `windows` windows."""

    def __init__(self, trace_dir: Path, interval: int, iterations: int, world: int, windows: int,
                 flush_s: float = 5.0, min_factor: float = 1.10):
        self.trace_dir, self.interval, self.iterations = trace_dir, interval, min(iterations, interval)
        self.world, self.windows, self.flush_s = world, windows, flush_s
        self.min_factor = min_factor
        self.next_window: int | None = None  # the first window this attempt will trace fully
        self.streak: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.reported: list[Straggler] = []
        self.notes: list[str] = []
        self._done_since: dict[int, float] = {}
        self._last_read = 0.0

    def poll(self, start_step: int, done_steps: int, final: bool = False) -> list[Straggler]:
        """Analyse every window finished by all ranks (`done_steps`: the fewest steps any rank completed). Spans
        reach the files through the tracer's writer thread, so a finished window is read once every rank's file
        holds the window's last optimizer step (or `flush_s` after it finished, or at the end of the attempt with
        `final`). Returns the findings that became persistent now."""
        if self.next_window is None:
            # a resumed attempt starts mid-interval: its first window may miss iterations; skip it
            first, _ = window_range(start_step // self.interval, self.interval, self.iterations)
            self.next_window = start_step // self.interval + (1 if first < start_step else 0)
        new: list[Straggler] = []
        while True:
            k = self.next_window
            first, last = window_range(k, self.interval, self.iterations)
            if done_steps < last + 1:
                return new
            now = time.time()
            since = self._done_since.setdefault(k, now)
            if not final and now - self._last_read < 0.5:
                return new  # read the files at most twice a second while waiting for them
            self._last_read = now
            try:
                traces, _ = read_dir(self.trace_dir)
            except FileNotFoundError as e:
                traces = []
                self.notes.append(f"window {k}: {e}")
            flushed = len(traces) == self.world and all(
                bool(((t.it == last) & (t.cat == CAT_INDEX["optimizer"])).any()) for t in traces)
            if not (final or flushed or now - since >= self.flush_s):
                return new
            new += self._analyse(traces, k, first, last)
            self.next_window = k + 1

    def _analyse(self, traces: list[RankTrace], k: int, first: int, last: int) -> list[Straggler]:
        from megatronapp.scan.detect.analysis import detect

        window = window_slice(traces, first, last)
        have = {t.rank for t in window if len(t)}
        if len(have) < self.world:
            missing = sorted(set(range(self.world)) - have)
            self.notes.append(f"window {k} (iterations {first}-{last}): no spans from rank(s) {missing}; skipped")
            self.streak.clear()  # no evidence either way: a streak must be consecutive windows
            return []
        report = detect(window)
        # A transient pause hits a few iterations of a window: repeated in every window it is periodic work
        # (seen on healthy runs: +9 ms in 1 of 2 iterations of every window, the tracer's own flush on 2 shared
        # cores), not a rank that is persistently slow, so it is never a straggler to evict.
        seen = {(f.kind, tuple(int(r) for r in f.ranks)): f for f in report.findings
                if f.kind != "transient-pause" and (not f.factor or f.factor >= self.min_factor)}
        self.streak = {key: [*self.streak.get(key, []), k] for key in seen}
        new = []
        for key, ks in self.streak.items():
            if len(ks) == self.windows:
                s = Straggler(key[0], key[1], ks, seen[key].describe().split(None, 1)[1])
                self.reported.append(s)
                new.append(s)
        return new

    def summary(self) -> dict[str, Any]:
        return {"stragglers": [dataclasses.asdict(s) for s in self.reported], "notes": self.notes}

