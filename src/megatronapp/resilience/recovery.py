"""Between two attempts: diagnose the machine, decide whom to evict, and choose the next attempt's layout.

MegaScale's order: after a failure, run the diagnostic tests on the job's machines, evict the bad ones, restart.
Here the tests are `diagnose.py` on the job's layout (per-rank GEMM and memory, every pair's P2P, every group's
all-reduce) within a time budget. Who is evicted: the rank the failure names (the rank killed by a signal, or
the rank a hang waits for), plus any rank whose memory check failed (a hard fault). Performance outliers of the
diagnostics (a slow GEMM, a slow link) are reported next to it but evict no one on their own: on a shared
machine a one-off slow test is not proof of a bad machine, and a wrongly evicted replica costs a dp.

On one machine there is no spare host to take the evicted rank's place, so eviction means: it is recorded (log,
`resilience.jsonl`, the run summary) and, with `--allow-shrink`, the next attempt runs without the evicted
rank's DP replica (`shrink.py`); without it, the same layout restarts.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from megatronapp.config import RunConfig
from megatronapp.parallel.topology import coord_of
from megatronapp.resilience import diagnose, shrink

# drills that model a property of the machine (they would show in its diagnostics), not a one-off event
MACHINE_DRILLS = ("slow-compute", "slow-link")


@dataclass
class Eviction:
    rank: int
    label: str
    dp: int  # the DP replica it belongs to (dropped with --allow-shrink)
    reason: str


@dataclass
class Plan:
    """What the driver does before the next attempt."""

    layout: RunConfig  # the next attempt's config (a smaller dp after a shrink)
    evicted: list[Eviction] = field(default_factory=list)
    replicas: list[int] | None = None  # after a shrink: old DP replica of each new one
    diagnosis: dict[str, Any] | None = None  # {"seconds", "report", "error", "outliers"}


def run_diagnostics(layout: RunConfig, drills: list[str], budget_s: float, threads: int | None) -> dict[str, Any]:
    """The diagnostics on `layout`'s ranks and groups; never raises (a timeout or a failed rank is the result)."""
    p = layout.parallel
    t0 = time.monotonic()
    world = p.world_size
    try:
        a = diagnose.run_within(world, (p.tp, p.pp, p.dp), drills, budget_s,
                                threads=threads or max(1, (os.cpu_count() or 1) // world))
    except Exception as e:  # noqa: BLE001 - a diagnostic that fails or hangs is a finding, not a driver crash
        return {"seconds": time.monotonic() - t0, "report": f"diagnostics failed: {e}", "error": str(e),
                "outliers": {}}
    outliers = {k: a[k] for k in ("gemm", "memory", "memory_errors", "p2p_bandwidth", "p2p_latency", "allreduce",
                                  "link_suspects") if a[k]}
    return {"seconds": time.monotonic() - t0, "report": diagnose.report(a), "error": None, "outliers": outliers}


def evictions(layout: RunConfig, failure_rank: int, failure_reason: str,
              diagnosis: dict[str, Any] | None) -> list[Eviction]:
    """The failure's named rank, and ranks whose memory check failed."""
    p = layout.parallel
    named = {failure_rank: failure_reason}
    for r in (diagnosis or {}).get("outliers", {}).get("memory_errors", []):
        named.setdefault(int(r), "memory check failed in the diagnostics")
    out = []
    for r, why in sorted(named.items()):
        c = coord_of(r, p.tp, p.pp, p.dp)
        out.append(Eviction(r, c.label(), c.dp, why))
    return out


def plan_restart(layout: RunConfig, first: RunConfig, failure: Any, *, diagnose_on_restart: bool,
                 diagnose_budget_s: float, allow_shrink: bool, threads: int | None,
                 log: Callable[[str], None]) -> Plan:
    """Diagnose (optional), name the evicted ranks, and pick the next layout."""
    diagnosis = None
    if diagnose_on_restart:
        # the injected bad machine is still bad when diagnosed, as long as rank numbers mean the same ranks
        drills = [s for s in first.inject if s.split("=")[0] in MACHINE_DRILLS] if layout is first else []
        log(f"diagnosing {layout.parallel.world_size} rank(s) before the restart (budget "
            f"{diagnose_budget_s:.0f} s)")
        diagnosis = run_diagnostics(layout, drills, diagnose_budget_s, threads)
        log(f"diagnostics ({diagnosis['seconds']:.1f} s):\n{diagnosis['report']}")
    reason = "the hang waits for it" if failure.kind == "hang" else failure.message
    evicted = evictions(layout, failure.rank, reason, diagnosis)
    plan = Plan(layout, evicted, diagnosis=diagnosis)
    for e in evicted:
        log(f"evicted: rank {e.rank} ({e.label}, DP replica {e.dp}): {e.reason}")
    dp = layout.parallel.dp
    bad = {e.dp for e in evicted}
    if not allow_shrink:
        log("no spare host on one machine: restarting with the same layout (--allow-shrink drops the evicted "
            "DP replica instead)")
        return plan
    keep = shrink.survivors(dp, bad)
    if not keep:
        log(f"every DP replica holds an evicted rank (dp={dp}): restarting with the same layout")
        return plan
    try:
        plan.layout = shrink.shrunk_config(layout, len(keep))
    except shrink.ShrinkRefused as e:
        log(f"cannot shrink: {e}; restarting with the same layout")
        return plan
    plan.replicas = keep
    q = plan.layout.parallel
    log(f"shrinking: dp {dp} -> {q.dp} (world {layout.parallel.world_size} -> {q.world_size}), keeping DP "
        f"replica(s) {', '.join(map(str, keep))}; global batch {layout.train.global_batch_size} kept with "
        f"{q.microbatches} microbatch(es) per replica (was {layout.parallel.microbatches})")
    return plan


def record(plan: Plan, attempt: int) -> dict[str, Any]:
    """The plan as an event for resilience.jsonl."""
    return {"event": "evicted", "attempt": attempt, "evicted": [asdict(e) for e in plan.evicted],
            "dp": plan.layout.parallel.dp, "replicas": plan.replicas, "diagnosis": plan.diagnosis}
