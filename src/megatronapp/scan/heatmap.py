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

from megatronapp.scan.detect import Analysis

METRICS = {
    "self vs stage": "self time (compute + data + untraced) / stage median",
    "compute ms": "exclusive compute ms per iteration",
    "waited ms": "ms per iteration blocked on other ranks",
    "others waited ms": "ms per iteration others waited for this rank (direct)",
}


def grids(an: Analysis) -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """Metric grids of shape (pp*dp, tp), the rank at each cell, and the row labels."""
    tb, ph, wt = an.table, an.phases, an.waits
    dp_n, pp_n, tp_n = (int(tb.coords[:, i].max()) + 1 for i in range(3))
    rank_at = np.full((pp_n * dp_n, tp_n), -1)
    for r, (d, p, t) in enumerate(tb.coords):
        if d >= 0:
            rank_at[p * dp_n + d, t] = r
    # Ranks without data (a missing file; two-level: ranks not read in full) are NaN rows: no warning for them.
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        st = np.nanmean(ph.self_time, axis=1)
        stage_med = np.array([np.nanmedian(st[tb.coords[:, 1] == p]) if (tb.coords[:, 1] == p).any() else np.nan
                              for p in range(pp_n)])
        per_rank = {"self vs stage": st / stage_med[tb.coords[:, 1].clip(0)],
                    "compute ms": np.nanmean(ph.compute, axis=1),
                    "waited ms": np.nanmean(wt.waited, axis=1),
                    "others waited ms": np.nanmean(wt.caused, axis=1)}
    out = {k: np.where(rank_at >= 0, v[rank_at.clip(0)], np.nan) for k, v in per_rank.items()}
    labels = [f"PP{p} DP{d}" for p in range(pp_n) for d in range(dp_n)]
    return out, rank_at, labels


def write_png(an: Analysis, path: str | Path) -> Path:
    """Save the heat-map panels as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    g, rank_at, labels = grids(an)
    rows = rank_at.shape[0]
    fig, axes = plt.subplots(1, len(g), figsize=(3.2 * len(g), max(3.0, min(14.0, 0.25 * rows + 1.5))),
                             squeeze=False)
    flagged = {r for f in an.report.findings for r in f.ranks}
    for ax, (name, m) in zip(axes[0], g.items()):
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma")
        fig.colorbar(im, ax=ax, fraction=0.046)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("TP rank")
        cols = m.shape[1]
        if cols <= 32:  # integer ticks: a TP rank is a cell, not a continuous axis
            ax.set_xticks(range(cols), [str(j) for j in range(cols)], fontsize=7)
        if rows <= 48:
            ax.set_yticks(range(rows), labels, fontsize=6)
        else:
            ax.set_ylabel("stage x DP replica (row = pp*dp + dp)")
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
<p>rows: pipeline stage x DP replica; columns: TP rank; boxed cells: ranks named by a finding.</p>
<h4>Findings</h4><ol id="findings"></ol><div id="tip"></div>
<script>
const D = __DATA__;
const sel = document.getElementById('metric'), cv = document.getElementById('c'), ctx = cv.getContext('2d');
const tip = document.getElementById('tip');
const cell = Math.max(2, Math.min(28, Math.floor(700 / Math.max(D.rows, D.cols))));
cv.width = D.cols * cell; cv.height = D.rows * cell;
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
    ctx.fillRect(j * cell, i * cell, cell, cell);
    if (D.flag[i * D.cols + j]) { ctx.strokeStyle = '#0ff'; ctx.lineWidth = 2;
      ctx.strokeRect(j * cell + 1, i * cell + 1, cell - 2, cell - 2); } } }
cv.onmousemove = e => { const b = cv.getBoundingClientRect();
  const j = Math.floor((e.clientX - b.left) / cell), i = Math.floor((e.clientY - b.top) / cell);
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


def write_html(an: Analysis, path: str | Path) -> Path:
    """Save an interactive, self-contained HTML heat-map (no network needed to view it)."""
    g, rank_at, labels = grids(an)
    flagged = {r for f in an.report.findings for r in f.ranks}

    def flat(m: np.ndarray) -> list:
        return [None if not np.isfinite(x) else round(float(x), 4) for x in m.ravel()]

    data = {"rows": int(rank_at.shape[0]), "cols": int(rank_at.shape[1]), "labels": labels,
            "rank": rank_at.ravel().tolist(), "metrics": {k: flat(v) for k, v in g.items()}, "desc": METRICS,
            "flag": [int(r in flagged) for r in rank_at.ravel()],
            "findings": [f.describe() for f in an.report.findings]}
    title = f"{an.report.world} ranks, {an.report.iterations} iterations"
    # json.dumps escapes nothing HTML-special; close-tag sequences must not end the script early.
    payload = json.dumps(data).replace("</", "<\\/")
    p = Path(path)
    p.write_text(_HTML.replace("__TITLE__", title).replace("__DATA__", payload), encoding="utf-8")
    return p


def write(an: Analysis, path: str | Path) -> Path:
    """PNG or HTML by the file suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".png":
        return write_png(an, path)
    if suffix in (".html", ".htm"):
        return write_html(an, path)
    raise ValueError(f"heat-map output {path}: use a .png or .html file name")
