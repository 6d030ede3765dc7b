"""Pipeline schedule pictures: stages x time, one bar per task, coloured by microbatch.

Forward bars are solid, backward bars hatched (ZB-H1's weight-gradient bars cross-hatched and paler); white
gaps are bubbles. Pictures come from a simulation (`SimResult`) or from a real MegaScan trace directory (spans
"forward"/"backward" with chunk and microbatch, on the ranks with dp = tp = 0). Output: PNG (matplotlib, Agg)
or a self-contained HTML page (inline SVG with hover titles, no external scripts).
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatronapp.dpp.simulator import SimResult, Span

_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


@dataclass
class Timeline:
    """What a picture shows: tasks per stage on one time axis (seconds from the step's start)."""

    title: str
    pp: int
    spans: list[Span]

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @staticmethod
    def from_result(r: SimResult) -> Timeline:
        """The timeline of a simulation, titled with its schedule, step time and bubble."""
        title = (f"{r.schedule}: step {r.step_time:.4g}, bubble {100 * r.bubble:.1f}%, "
                 f"peak in-flight {max(r.peak_activation):.3g}")
        return Timeline(title, r.pp, list(r.timeline))


def timeline_from_trace(trace_dir: str | Path, iteration: int | None = None) -> tuple[Timeline, list[str]]:
    """Forward/backward spans of one traced iteration (the last complete one by default) from a MegaScan trace
    directory, on aligned clocks; returns the timeline and the problems met while reading."""
    from megatronapp.scan.read.format import read_dir

    traces, problems = read_dir(trace_dir)
    stages = [t for t in traces if t.coord[0] == 0 and t.coord[2] == 0]
    if not stages:
        raise ValueError(f"{trace_dir}: no readable trace of a dp=0, tp=0 rank; problems: {problems}")
    offsets, report = _clock_offsets(traces)
    pp = max(t.topo[1] for t in stages)
    rows: list[tuple[int, str, int, int, int, int, int]] = []  # (iteration, kind, stage, chunk, mb, ts, dur)
    for t in stages:
        ids = {t.name_id("forward"): "F", t.name_id("backward"): "B", t.name_id("weight_grad"): "W"}
        ids.pop(-1, None)
        if not ids:
            continue
        sel = np.isin(t.name, list(ids))
        if iteration is not None:
            sel &= t.it == iteration
        ts = _aligned(t.rank, t.ts[sel], offsets, report)
        for n, it, start, dur, c, mb in zip(t.name[sel], t.it[sel], ts, t.dur[sel], t.chunk[sel], t.mb[sel]):
            rows.append((int(it), ids[int(n)], t.coord[1], max(int(c), 0), int(mb), int(start), int(dur)))
    if not rows:
        raise ValueError(f"{trace_dir}: no forward/backward spans"
                         f"{'' if iteration is None else f' in iteration {iteration}'}; was the run traced?")
    if iteration is None:  # the last iteration that has spans from every stage present
        per_it: dict[int, set[int]] = {}
        for it, _, s, *_ in rows:
            per_it.setdefault(it, set()).add(s)
        full = [it for it, ss in per_it.items() if len(ss) == len(stages)]
        iteration = max(full) if full else max(per_it)
    rows = [r for r in rows if r[0] == iteration]
    t0 = min(r[5] for r in rows)
    spans = [Span(s, k, c, mb, (start - t0) / 1e9, (start + dur - t0) / 1e9) for _, k, s, c, mb, start, dur in rows]
    spans.sort(key=lambda x: (x.stage, x.start))
    return Timeline(f"{Path(trace_dir).name}: iteration {iteration}", pp, spans), problems


def _clock_offsets(traces: list) -> tuple[dict[int, int], dict]:
    """Per-rank clock offsets to rank 0 from MegaScan's alignment (collective ends, handshake, P2P bounds)."""
    from megatronapp.scan.detect.align import estimate_offsets

    offsets, _, report = estimate_offsets(traces)
    return offsets, report


def _aligned(rank: int, ts: np.ndarray, offsets: dict[int, int], report: dict) -> np.ndarray:
    from megatronapp.scan.detect.align import to_reference

    return to_reference(rank, ts, offsets, report)


def _colour(mb: int) -> str:
    return _PALETTE[mb % len(_PALETTE)]


def plot_png(timelines: Sequence[Timeline], path: str | Path) -> Path:
    """Draw each timeline as a panel (stages top to bottom) and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(timelines)
    heights = [max(1.2, min(0.22 * t.pp, 8.0)) + 0.6 for t in timelines]
    fig, axes = plt.subplots(n, 1, figsize=(14, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, tl in zip(axes[:, 0], timelines):
        groups: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        for s in tl.spans:
            groups.setdefault((s.stage, s.kind, s.microbatch % len(_PALETTE)), []).append((s.start, s.end - s.start))
        for (stage, kind, col), bars in groups.items():
            style = {"F": {"alpha": 1.0, "hatch": None}, "B": {"alpha": 0.85, "hatch": "////"},
                     "W": {"alpha": 0.45, "hatch": "xx"}}[kind]
            ax.broken_barh(bars, (stage - 0.4, 0.8), facecolors=_PALETTE[col], edgecolor="black",
                           linewidth=0.2 if len(tl.spans) < 3000 else 0.0, **style)
        if len(tl.spans) <= 400:
            for s in tl.spans:
                ax.text((s.start + s.end) / 2, s.stage, f"{s.kind}{s.microbatch}", ha="center", va="center",
                        fontsize=5, color="white" if s.kind == "F" else "black")
        ax.set_ylim(tl.pp - 0.5, -0.5)
        ax.set_xlim(0, tl.end * 1.005 or 1.0)
        ax.set_ylabel("stage")
        ax.set_title(tl.title, fontsize=9, loc="left")
        if tl.pp <= 16:
            ax.set_yticks(range(tl.pp))
    axes[-1, 0].set_xlabel("time (s)")
    legend = [Patch(facecolor="#999999", label="forward"), Patch(facecolor="#999999", hatch="////", label="backward"),
              Patch(facecolor="#999999", alpha=0.45, hatch="xx", label="weight grad (ZB)"),
              Patch(facecolor="white", edgecolor="#999999", label="bubble (idle)")]
    axes[0, 0].legend(handles=legend, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=4, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_html(timelines: Sequence[Timeline], path: str | Path) -> Path:
    """Write a self-contained HTML page (inline SVG; hover a bar for its task and times)."""
    width, row, left = 1200, 18, 60
    head = ("<!doctype html><html><head><meta charset='utf-8'><title>MegaDPP schedule</title><style>"
            "body{font-family:sans-serif;margin:16px} h2{font-size:14px;margin:18px 0 4px}"
            " rect.B{fill-opacity:.55} rect.W{fill-opacity:.3} .lg span{display:inline-block;margin-right:14px}"
            "</style></head><body><div class='lg'><span>&#9608; forward</span><span style='opacity:.55'>&#9608; "
            "backward</span><span style='opacity:.3'>&#9608; weight grad (ZB)</span><span>white: bubble</span>"
            "<span>colour: microbatch</span></div>")
    parts = [head]
    for tl in timelines:
        end = tl.end or 1.0
        scale = (width - left - 10) / end
        h = tl.pp * row + 24
        parts.append(f"<h2>{html.escape(tl.title)}</h2>")
        parts.append(f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{h}' "
                     f"font-size='10' font-family='sans-serif'>")
        for s in range(tl.pp):
            y = s * row
            parts.append(f"<rect x='{left}' y='{y}' width='{width - left - 10}' height='{row - 2}' fill='#f4f4f4'/>"
                         f"<text x='4' y='{y + row - 6}'>stage {s}</text>")
        for sp in tl.spans:
            x, w = left + sp.start * scale, max((sp.end - sp.start) * scale, 0.5)
            tip = f"{sp.kind}{sp.chunk}.{sp.microbatch} stage {sp.stage}: {sp.start:.6g} to {sp.end:.6g}"
            stroke = " stroke='#000' stroke-width='0.6'" if sp.kind != "F" else ""
            parts.append(f"<rect class='{sp.kind}' x='{x:.2f}' y='{sp.stage * row + 1}' width='{w:.2f}' "
                         f"height='{row - 4}' fill='{_colour(sp.microbatch)}'{stroke}><title>{tip}</title></rect>")
        parts.append(f"<text x='{left}' y='{h - 6}'>0</text><text x='{width - 10}' y='{h - 6}' "
                     f"text-anchor='end'>{end:.4g} s</text></svg>")
    parts.append("</body></html>")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    return out


def save(timelines: Sequence[Timeline], path: str | Path) -> Path:
    """Save as HTML when `path` ends in .html/.htm, else as PNG."""
    if Path(path).suffix.lower() in (".html", ".htm"):
        return plot_html(timelines, path)
    return plot_png(timelines, path)
