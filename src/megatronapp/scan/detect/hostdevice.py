"""On a GPU trace, whether a late rank's host or its device was late.

A rank can be behind its peers because its device runs its kernels slower (a slow or throttled GPU) or because
its host launched them late (a data loader, a garbage collection, a CPU-bound step): the first shows as longer
kernels, the second as the device sitting idle with nothing launched yet. The GPU reader records, per iteration,
how long the device waited for launches (`host_idle_ms` in the header: gpu_kineto.host_idle); here a finding's
excess is set against the rank's excess of that idle time over its peers in the same iterations."""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.detect.table import Phases, Table
from megatronapp.scan.read.format import RankTrace

_KINDS = ("slow-compute", "late-arrival", "transient-pause")


def host_idle_table(traces: list[RankTrace], world: int, iters: np.ndarray) -> np.ndarray | None:
    """[rank, iteration] ms each rank's device waited for its host (NaN unknown); None when no trace says."""
    out = np.full((world, max(len(iters), 1)), np.nan)
    seen = False
    for t in traces:
        idle = (t.header.get("gpu") or {}).get("host_idle_ms") if isinstance(t.header.get("gpu"), dict) else None
        if not isinstance(idle, dict) or not 0 <= t.rank < world:
            continue
        for k, v in idle.items():
            try:
                i = int(np.searchsorted(iters, int(k)))
            except (TypeError, ValueError):
                continue
            if i < len(iters) and iters[i] == int(k) and isinstance(v, (int, float)):
                out[t.rank, i] = float(v)
                seen = True
    return out if seen else None


def attribute(findings: list[Finding], tb: Table, ph: Phases, idle: np.ndarray | None) -> None:
    """Add `late` (host or device, and by how much) to the evidence of each rank finding on a GPU trace."""
    if idle is None:
        return
    present = tb.present
    stage = tb.coords[:, 1]
    for f in findings:
        if f.kind not in _KINDS or len(f.ranks) != 1:
            continue
        r = f.ranks[0]
        peers = np.flatnonzero(present & (stage == stage[r]) & (np.arange(tb.world) != r))
        cols = np.flatnonzero(np.isin(ph.iters, f.evidence.get("iterations") or ph.iters))
        if not len(peers) or not len(cols) or np.isnan(idle[r, cols]).all():
            continue
        with np.errstate(all="ignore"):
            host = float(np.nanmedian(idle[r, cols] - np.nanmedian(idle[peers][:, cols], axis=0)))
            device = float(np.nanmedian(ph.compute[r, cols] - np.nanmedian(ph.compute[peers][:, cols], axis=0)))
        if not np.isfinite(host) or not np.isfinite(device):
            continue
        host, device = round(host, 1) + 0.0, round(device, 1) + 0.0  # + 0.0: no "-0.0 ms" in the text
        f.evidence["host_late_ms"] = round(host, 3)
        f.evidence["device_late_ms"] = round(device, 3)
        if host >= max(device, 0.0) and host > 0:
            f.evidence["late"] = (f"the host: its GPU sat idle +{host:.1f} ms per iteration waiting for kernel "
                                  f"launches (its kernels {device:+.1f} ms against its peers')")
        elif device > 0:
            f.evidence["late"] = (f"the device: its kernels ran {device:+.1f} ms per iteration longer than its peers' "
                                  f"(its GPU waited for launches {host:+.1f} ms against theirs)")
