"""MegaScan findings: what detection reports (ranked suspects with evidence) and the thresholds it applies."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist

KINDS = ("hang", "slow-compute", "slow-link", "transient-pause", "late-arrival")


def link_label(ranks) -> str:
    """A slow link's ranks for a finding's text: `a-b` for a pair, else group_label."""
    return f"{ranks[0]}-{ranks[1]}" if len(ranks) == 2 else group_label(ranks)


def group_label(ranks) -> str:
    """A group of ranks for a finding's text: every member of a small group, the first few and the count of a large
    one (a DP group at 100,096 ranks has 782 members; listing them made one finding 5,000 characters long)."""
    rks = [int(r) for r in ranks]
    if len(rks) <= 8:
        return f"group {rks}"
    return f"group [{', '.join(map(str, rks[:4]))}, ..., {rks[-1]}] ({len(rks)} ranks)"


@dataclass
class Thresholds:
    """When a difference counts as a fault: all of relative, absolute and robust-z minimums must hold."""

    rel: float = 0.05  # self time above peers' median, per iteration
    abs_ms: float = 0.5
    z: float = 4.0
    persistent: float = 0.6  # fraction of iterations for a persistent fault
    transient_rel: float = 0.08  # a one-off must stand out more than a persistent shift
    transient_abs_ms: float = 2.0
    link_rel: float = 0.08  # median transfer time above peers' median
    link_z: float = 5.0  # many links are compared at once: a stricter z keeps the false-alarm rate down
    link_abs_ms: float = 0.01
    link_noise: float = 1.0  # the excess must also reach the typical jitter of one transfer of the run
    link_sign_p: float = 0.05  # and most of its transfers must be slow: one-sided sign test against its class
    link_share: float = 0.01  # a slow link by its floor: its excess per iteration >= 1% of the iteration
    scale_floor: float = 0.01  # MAD is floored at 1% of the median: identical peers are not infinitely sure
    # Busy machines and few peers (evidence.py): effects must also stand above the run's own jitter.
    transient_noise: float = 3.0  # a one-off excess >= 3x the typical upward jitter of a healthy rank
    persistent_noise: float = 1.0  # a persistent excess >= that jitter in each counted iteration
    floor_q: float = 0.1  # an op's floor: this quantile of its repeats
    floor_rel: float = 0.4  # floors above peers' by 40% (measured: healthy ranks on a 2-core box at load 20 reach 1.3x)
    # A lone stage's fastest layer per iteration above the other stages' (the same op, CPU waits out): healthy
    # ranks of the stored pure-pipeline recordings reach 1.12x (median over iterations).
    layer_rel: float = 0.2
    stall_abs_ms: float = 2.0  # stall before posting a send, beyond the same send on other columns
    stall_floor_ms: float = 0.1  # a healthy posting delay is taken as at least this (for the ratio)
    # False alarms at scale: thousands of comparisons at a fixed z make some noise pass it. The z needed grows
    # with the number of comparisons so the chance of ANY false alarm in a healthy run stays near this (a
    # Bonferroni bound; with almost every comparison healthy, Benjamini-Hochberg asks for the same z).
    family_alpha: float = 0.01

    def z_for(self, base: float, comparisons: int) -> float:
        """The z a comparison must reach when `comparisons` are made at once: `base`, or more at scale."""
        if comparisons <= 1:
            return base
        return max(base, NormalDist().inv_cdf(1.0 - self.family_alpha / comparisons))


@dataclass
class Finding:
    """One suspected root cause."""

    kind: str
    ranks: tuple[int, ...]  # (rank,) or the two ends of a link, or a whole collective group
    coords: list[dict]  # [{"rank", "dp", "pp", "tp"}] for each rank
    slowdown: str  # human form: "1.30x compute", "+45.0 ms in 2 of 5 iterations"
    factor: float  # measured ratio to peers (1.0 = like peers)
    excess_ms: float  # extra ms per affected iteration / transfer
    confidence: float
    evidence: dict = field(default_factory=dict)

    @property
    def link(self) -> tuple[int, int] | None:
        return (self.ranks[0], self.ranks[1]) if self.kind == "slow-link" and len(self.ranks) == 2 else None

    def describe(self) -> str:
        where = ", ".join(f"rank {c['rank']} (DP{c['dp']} PP{c['pp']} TP{c['tp']})" for c in self.coords[:4])
        if len(self.coords) > 4:
            where += f" ... ({len(self.coords)} ranks)"
        return f"{self.kind:<15} {where}: {self.slowdown}, confidence {self.confidence:.2f}"


@dataclass
class Report:
    """Ranked findings plus the context needed to read them."""

    findings: list[Finding]
    world: int
    iterations: int
    step_ms: float  # median iteration time
    waited_for: list[dict]  # top ranks others waited for (victims filtered), ms
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        """Strict JSON (RFC 8259): a value that is not a finite number is written as null, never as the
        `Infinity`/`NaN` Python's json emits by default, which strict readers (jq, JavaScript, Go) refuse."""
        return json.dumps(_finite({"world": self.world, "iterations": self.iterations, "step_ms": self.step_ms,
                                   "findings": [{**asdict(f), "link": f.link} for f in self.findings],
                                   "waited_for": self.waited_for, "notes": self.notes}), indent=1, allow_nan=False)

    def to_text(self) -> str:
        lines = [(f"MegaScan detect: {self.world} ranks, {self.iterations} iterations, "
                 f"median iteration {self.step_ms:.1f} ms")]
        if not self.findings:
            lines.append("no root cause found: every rank and link is within noise of its peers")
        for i, f in enumerate(self.findings, 1):
            lines.append(f"{i:>2}. {f.describe()}")
            ev = f.evidence
            if "floor_ratio_by_op" in ev:
                lines.append(f"      fastest repeats vs {ev['peers']} peer(s): {ev['floor_ratio_by_op']}; "
                             f"iterations {ev['iterations']}")
            elif "layer_floor_ms" in ev:
                lines.append(f"      fastest '{ev['layer_kind']}' span per iteration {ev['layer_floor_ms']:.3f} ms vs "
                             f"the other stages' {ev['other_stages_layer_floor_ms']:.3f} ms; iterations "
                             f"{ev['iterations']}")
            elif "iterations" in ev:
                lines.append(f"      iterations {ev['iterations']}; ops {ev.get('ops', {})}")
            if ev.get("method") == "ring exit pattern":
                more = " ..." if len(ev["group"]) > 8 else ""
                lines.append(f"      in {ev['group_kind']} group {ev['group'][:8]}{more} ({len(ev['group'])} ranks)"
                             f": exits step {ev['exit_step_ms']:.3f} ms across this link, "
                             f"the next largest {ev['next_step_ms']:.3f} ms")
            if ev.get("probe"):
                lines.append(f"      confirm: {ev['probe']}")
            if ev.get("others_waited_ms"):
                lines.append(f"      others waited {ev['others_waited_ms']:.1f} ms for it")
            if ev.get("method") == "send stalls":
                lines.append(f"      {ev['transfers']} sends, median posting delay {ev['median_ms']:.3f} ms vs "
                             f"peer links {ev['peer_median_ms']:.3f} ms")
            elif "floor_ms" in ev:
                lines.append(f"      {ev['transfers']} transfers, fastest {ev['floor_ms']:.3f} ms vs "
                             f"{ev.get('peers', 'peers')} {ev['peer_floor_ms']:.3f} ms")
            elif "transfers" in ev:
                lines.append(f"      {ev['transfers']} transfers, median {ev['median_ms']:.3f} ms vs "
                             f"peers {ev['peer_median_ms']:.3f} ms")
        if self.waited_for:
            top = ", ".join(f"rank {w['rank']} {w['ms']:.1f} ms" for w in self.waited_for[:5])
            lines.append(f"who everyone waits for (direct waits caused, victims excluded): {top}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _finite(obj: object) -> object:
    """`obj` with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
