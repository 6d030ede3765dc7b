"""Per-rank summary table for the terminal: where each rank's iteration time went, and who was flagged."""
from __future__ import annotations

import warnings

import numpy as np

from megatronapp.scan.detect.analysis import Analysis

COLUMNS = ("rank", "DP", "PP", "TP", "iter ms", "compute", "data", "gap", "comm", "waited", "others waited",
           "finding")


def rank_rows(an: Analysis) -> list[dict]:
    """One dict per traced rank: mean ms per iteration of each phase, plus its finding kinds."""
    ph, wt, tb = an.phases, an.waits, an.table
    flagged: dict[int, list[str]] = {}
    for f in an.report.findings:
        for r in f.ranks:
            flagged.setdefault(r, []).append(f.kind)
    present = np.flatnonzero(tb.present)
    # Ranks without data (a missing file; two-level: ranks not read in full) are NaN rows: no warning for them.
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = {k: np.nanmean(v, axis=1) for k, v in (("iter ms", ph.window), ("compute", ph.compute),
                                                       ("data", ph.data), ("gap", ph.gap), ("comm", ph.comm),
                                                       ("waited", wt.waited), ("others waited", wt.caused))}
    rows = []
    for r in present:
        dp, pp, tp = (int(x) for x in tb.coords[r])
        row = {"rank": int(r), "DP": dp, "PP": pp, "TP": tp}
        row.update({k: round(float(v[r]), 2) for k, v in mean.items()})
        row["finding"] = ",".join(flagged.get(int(r), []))
        rows.append(row)
    return rows


def summary_table(an: Analysis, limit: int | None = 40) -> str:
    """A fixed-width table: all ranks when they fit in `limit`, else the flagged ranks and the slowest others."""
    rows = rank_rows(an)
    shown = rows
    hidden = 0
    if limit is not None and len(rows) > limit:
        flagged = [r for r in rows if r["finding"]]
        rest = sorted((r for r in rows if not r["finding"]), key=lambda r: -(r["compute"] + r["data"] + r["gap"]))
        shown = sorted(flagged + rest[:max(limit - len(flagged), 0)], key=lambda r: r["rank"])
        hidden = len(rows) - len(shown)
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in shown)) if shown else len(c) for c in COLUMNS}
    lines = ["  ".join(c.rjust(widths[c]) if c != "finding" else c for c in COLUMNS)]
    lines += ["  ".join(_fmt(r[c]).rjust(widths[c]) if c != "finding" else r[c] for c in COLUMNS) for r in shown]
    lines.append(f"(ms per iteration, mean over {an.report.iterations} iterations; waited = blocked on others, "
                 "others waited = waits this rank caused directly)")
    if hidden:
        lines.append(f"{hidden} more ranks not shown (healthy; use --all)")
    return "\n".join(lines)


def _fmt(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
