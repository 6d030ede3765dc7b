"""Heat-maps of the rank grid: rows are (pipeline stage, DP replica), columns TP ranks; one panel per phase.

Values are ms per iteration (mean over iterations) of self time relative to the stage median, compute, waiting
and waits caused; ranks named by a finding get a box. PNG via matplotlib (Agg, no display needed); HTML is
one self-contained file (canvas + a little inline JS, no CDN) with a metric picker and a hover read-out.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from megatronapp.scan.detect.analysis import Analysis

METRICS = {
    "self vs stage": "self time (compute + data + untraced) / stage median",
    "compute ms": "exclusive compute ms per iteration",
    "waited ms": "ms per iteration blocked on other ranks",
    "others waited ms": "ms per iteration others waited for this rank (direct)",
}
# Two-level (a job too large for one table): the first two panels come from the triage's numbers of every rank, the
# last two from the full analysis of the ranks it read (blank elsewhere).
METRICS_TWO_LEVEL = {
    "self vs stage": "every rank (triage): own work + host time / stage median",
    "compute ms": "every rank (triage): own work (compute + optimizer less nested comm) ms per iteration",
    "waited ms": "ranks read in full: ms per iteration blocked on other ranks",
    "others waited ms": "ranks read in full: ms per iteration others waited for this rank (direct)",
}
TRIAGE_PANELS = ("self vs stage", "compute ms")
MAX_ROWS_PNG, MAX_ROWS_HTML = 1_200, 4_000  # past these, rows are binned (a pixel row of a 14-inch PNG is ~8)


def grids(an: Analysis, features=None, max_rows: int | None = None
          ) -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """Metric grids of shape (rows, tp), the rank at each cell, and the row labels. Rows are (stage, DP replica);
    past `max_rows` each stage's replicas are binned, a cell showing the rank of its bin named by a finding, else
    the one highest in "self vs stage" (a lone slow rank stays visible; its bin's label says which replicas).
    `features` (features.Features, two-level): every rank's own work and host time fill the first two panels."""
    tb, ph, wt = an.table, an.phases, an.waits
    coords = features.coords if features is not None else tb.coords
    dp_n, pp_n, tp_n = (int(coords[:, i].max()) + 1 for i in range(3))
    rank_at = np.full((pp_n * dp_n, tp_n), -1)
    present = np.flatnonzero(coords[:, 0] >= 0)
    d_, p_, t_ = coords[present].T
    rank_at[p_ * dp_n + d_, t_] = present
    stage = coords[:, 1].clip(0)
    # Ranks without data (a missing file; two-level: ranks not read in full) are NaN rows: no warning for them.
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if features is not None:
            st = np.nanmean(features.work + features.host, axis=1)
            compute = np.nanmean(features.work, axis=1)
        else:
            st = np.nanmean(ph.self_time, axis=1)
            compute = np.nanmean(ph.compute, axis=1)
        stage_med = np.array([np.nanmedian(st[(coords[:, 1] == p)]) if (coords[:, 1] == p).any() else np.nan
                              for p in range(pp_n)])
        per_rank = {"self vs stage": st / stage_med[stage], "compute ms": compute,
                    # (a rank not read has no waits: blank, not 0)
                    "waited ms": _fit(np.where(tb.present, np.nanmean(wt.waited, axis=1), np.nan), len(coords)),
                    "others waited ms": _fit(np.where(tb.present, np.nanmean(wt.caused, axis=1), np.nan),
                                             len(coords))}
    labels = [f"PP{p} DP{d}" for p in range(pp_n) for d in range(dp_n)]
    if max_rows and len(rank_at) > max_rows:
        rank_at, labels = _binned(rank_at, per_rank["self vs stage"], {r for f in an.report.findings for r in f.ranks},
                                  pp_n, dp_n, max_rows)
    out = {k: np.where(rank_at >= 0, v[rank_at.clip(0)], np.nan) for k, v in per_rank.items()}
    return out, rank_at, labels


def _fit(a: np.ndarray, n: int) -> np.ndarray:
    """`a` over n ranks: the analysis read a subset and its world can be smaller than the triage's (a directory
    holding files of two jobs, a summary claiming a larger world); ranks past its end are blank."""
    out = np.full(n, np.nan)
    out[:min(n, len(a))] = a[:n]
    return out


def _binned(rank_at: np.ndarray, score: np.ndarray, flagged: set[int], pp_n: int, dp_n: int,
            max_rows: int) -> tuple[np.ndarray, list[str]]:
    """Each stage's replicas in bins of k, a bin's cell showing one of its ranks: a flagged one, else the highest
    `score` (NaN lowest)."""
    k = -(-dp_n * pp_n // max_rows)
    per_stage = -(-dp_n // k)
    pad = per_stage * k - dp_n
    grid = np.pad(rank_at.reshape(pp_n, dp_n, -1), ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    grid = grid.reshape(pp_n, per_stage, k, -1)
    # A rank without a score still beats an empty slot (-inf): a bin shows blank only when it holds no rank.
    sc = np.where(grid >= 0, np.nan_to_num(score[grid.clip(0)], nan=-1e300), -np.inf)
    if flagged:
        sc = np.where(np.isin(grid, list(flagged)), np.inf, sc)
    pick = np.argmax(sc, axis=2)[:, :, None, :]
    binned = np.take_along_axis(grid, pick, axis=2)[:, :, 0, :].reshape(pp_n * per_stage, -1)
    labels = [f"PP{p} DP{b * k}-{min(b * k + k, dp_n) - 1}" for p in range(pp_n) for b in range(per_stage)]
    return binned, labels


def write_png(an: Analysis, path: str | Path, features=None) -> Path:
    """Save the heat-map panels as a PNG (rows binned past MAX_ROWS_PNG; `features`: as grids')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    g, rank_at, labels = grids(an, features, MAX_ROWS_PNG)
    rows = rank_at.shape[0]
    fig, axes = plt.subplots(1, len(g), figsize=(3.2 * len(g), max(3.0, min(14.0, 0.25 * rows + 1.5))),
                             squeeze=False)
    flagged = {r for f in an.report.findings for r in f.ranks}
    for ax, (name, m) in zip(axes[0], g.items()):
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma")
        fig.colorbar(im, ax=ax, fraction=0.046)
        ax.set_title(name + (" (triage, every rank)" if features is not None and name in TRIAGE_PANELS else
                             " (ranks read)" if features is not None else ""), fontsize=9)
        ax.set_xlabel("TP rank")
        cols = m.shape[1]
        if cols <= 32:  # integer ticks: a TP rank is a cell, not a continuous axis
            ax.set_xticks(range(cols), [str(j) for j in range(cols)], fontsize=7)
        if rows <= 48:
            ax.set_yticks(range(rows), labels, fontsize=6)
        else:  # a tick where each stage starts; the label says what a row is
            starts = [i for i, lab in enumerate(labels) if i == 0 or lab.split()[0] != labels[i - 1].split()[0]]
            every = max(1, len(starts) // 16)
            ax.set_yticks(starts[::every], [labels[i].split()[0] for i in starts[::every]], fontsize=7)
            last = labels[0].split()[1].partition("-")[2]  # binned: "DP0-10", the first bin of 11 replicas
            ax.set_ylabel("stage x DP replica" + (f" (a row: {int(last) + 1} replicas, its flagged or worst rank)"
                                                  if last else ""))
        for (i, j), r in np.ndenumerate(rank_at):
            if r in flagged:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="cyan", lw=1.5))
    kinds = ", ".join(f"{f.kind} {list(f.ranks)[:4]}" for f in an.report.findings[:4]) or "no findings"
    fig.suptitle(f"MegaScan: {an.report.world} ranks, {an.report.iterations} iterations; {kinds}", fontsize=9)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


_HTML = """<!doctype html><html><head><meta charset="utf-8"><title>MegaScan heat-map</title>
<style>body{font:13px sans-serif;margin:16px}canvas{border:1px solid #ccc;image-rendering:pixelated}
#tip{position:fixed;background:#222;color:#fff;padding:4px 6px;border-radius:3px;display:none;font-size:12px}
li{margin:2px 0}</style></head><body>
<h3>MegaScan heat-map: __TITLE__</h3>
<label>metric <select id="metric"></select></label> <span id="desc"></span>
<div><canvas id="c"></canvas></div>
<p>rows: pipeline stage x DP replica (a row of several replicas shows its flagged or worst rank: hover for
which); columns: TP rank; boxed cells: ranks named by a finding.</p>
<h4>Findings</h4><ol id="findings"></ol><div id="tip"></div>
<script>
const D = __DATA__;
const sel = document.getElementById('metric'), cv = document.getElementById('c'), ctx = cv.getContext('2d');
const tip = document.getElementById('tip');
// Cells as wide as 700 px allow and as tall (at least 2 px: a tall job scrolls; its rows are binned past 4,000).
const cw = Math.max(2, Math.min(28, Math.floor(700 / D.cols)));
const ch = Math.max(2, Math.min(cw, Math.floor(700 / D.rows)));
cv.width = D.cols * cw; cv.height = D.rows * ch;
for (const m in D.metrics) { const o = document.createElement('option'); o.text = m; sel.add(o); }
function color(t) { // t in [0,1]: dark blue -> yellow -> red
  const r = Math.round(255 * Math.min(1, 2 * t)), g = Math.round(255 * Math.min(1, 2 - 2 * t) * t * 1.6);
  const b = Math.round(160 * (1 - t)); return `rgb(${r},${Math.min(255, g)},${b})`; }
function draw() {
  const v = D.metrics[sel.value]; document.getElementById('desc').textContent = D.desc[sel.value];
  let lo = Infinity, hi = -Infinity;
  for (const x of v) if (x !== null) { lo = Math.min(lo, x); hi = Math.max(hi, x); }
  for (let i = 0; i < D.rows; i++) for (let j = 0; j < D.cols; j++) {
    const x = v[i * D.cols + j];
    ctx.fillStyle = x === null ? '#eee' : color(hi > lo ? (x - lo) / (hi - lo) : 0.5);
    ctx.fillRect(j * cw, i * ch, cw, ch); }
  for (let i = 0; i < D.rows; i++) for (let j = 0; j < D.cols; j++) if (D.flag[i * D.cols + j]) {
    ctx.strokeStyle = '#0ff'; ctx.lineWidth = 2;  // after every fill: a 2 px row's box is not painted over
    ctx.strokeRect(j * cw + 1, i * ch + 1 - (ch < 6 ? 2 : 0), cw - 2, Math.max(ch - 2, 4)); } }
cv.onmousemove = e => { const b = cv.getBoundingClientRect();
  const j = Math.floor((e.clientX - b.left) / cw), i = Math.floor((e.clientY - b.top) / ch);
  if (i < 0 || j < 0 || i >= D.rows || j >= D.cols) { tip.style.display = 'none'; return; }
  const k = i * D.cols + j; let s = `rank ${D.rank[k]} ${D.labels[i]} TP${j}`;
  for (const m in D.metrics) { const x = D.metrics[m][k]; s += `<br>${m}: ${x === null ? '-' : x.toFixed(3)}`; }
  tip.innerHTML = s; tip.style.display = 'block'; tip.style.left = (e.clientX + 12) + 'px';
  tip.style.top = (e.clientY + 12) + 'px'; };
cv.onmouseleave = () => { tip.style.display = 'none'; };
for (const f of D.findings) { const li = document.createElement('li'); li.textContent = f;
  document.getElementById('findings').appendChild(li); }
if (!D.findings.length) document.getElementById('findings').outerHTML = '<p>no root cause found</p>';
sel.onchange = draw; draw();
</script></body></html>
"""


def write_html(an: Analysis, path: str | Path, features=None) -> Path:
    """Save an interactive, self-contained HTML heat-map (no network needed to view it); rows binned past
    MAX_ROWS_HTML, `features` as grids'."""
    g, rank_at, labels = grids(an, features, MAX_ROWS_HTML)
    flagged = {r for f in an.report.findings for r in f.ranks}

    def flat(m: np.ndarray) -> list:
        return [None if not np.isfinite(x) else round(float(x), 4) for x in m.ravel()]

    data = {"rows": int(rank_at.shape[0]), "cols": int(rank_at.shape[1]), "labels": labels,
            "rank": rank_at.ravel().tolist(), "metrics": {k: flat(v) for k, v in g.items()},
            "desc": METRICS_TWO_LEVEL if features is not None else METRICS,
            "flag": [int(r in flagged) for r in rank_at.ravel()],
            "findings": [f.describe() for f in an.report.findings]}
    title = f"{an.report.world} ranks, {an.report.iterations} iterations"
    # json.dumps escapes nothing HTML-special; close-tag sequences must not end the script early.
    payload = json.dumps(data).replace("</", "<\\/")
    p = Path(path)
    p.write_text(_HTML.replace("__TITLE__", title).replace("__DATA__", payload), encoding="utf-8")
    return p


def write(an: Analysis, path: str | Path, features=None) -> Path:
    """PNG or HTML by the file suffix. `features` (features.Features of a two-level analysis): every rank drawn."""
    suffix = Path(path).suffix.lower()
    if suffix == ".png":
        return write_png(an, path, features)
    if suffix in (".html", ".htm"):
        return write_html(an, path, features)
    raise ValueError(f"heat-map output {path}: use a .png or .html file name")
