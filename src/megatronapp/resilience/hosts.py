"""Hosts in a multi-host job's heartbeats: which ranks live where, and what became of a host that left the job.

Every beat of a rank started by torchrun carries its host's address and torchrun node (`elastic.host_address`);
in containers and network namespaces the host name is the same everywhere, so the address is the host's name.

A host leaves the job when torchrun replaces it (its rendezvous keep-alive expired and a standby host took its
place in a new start of the workers, `fence.py`). Whether it died or was cut off shows in its ranks' last beats,
judged against when the new start began:

- they beat until the new start (and were then fenced): the processes ran while the host dropped out of the
  rendezvous, so it lost its network: **cut off**;
- they stopped beating before: the host is **lost** (down, or cut off from both the network and the shared file
  system the heartbeats go through; from here the two look the same).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostLeft:
    addr: str
    node: int | None
    ranks: list[int]
    verdict: str  # "cut off" | "lost"
    last_beat: float
    replaced_at: float  # when the start that replaced it began
    message: str


def hosts_of(beats: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
    """Host address -> its ranks, from beats that carry an address."""
    out: dict[str, list[int]] = {}
    for r, b in sorted(beats.items()):
        if isinstance(b.get("addr"), str):
            out.setdefault(b["addr"], []).append(r)
    return out


def host_text(addr: str, ranks: list[int], labels: dict[int, str], node: int | None = None) -> str:
    """'host 10.0.0.2 (node 1; ranks 2, 3: DP0-PP1-TP0, DP0-PP1-TP1)'."""
    where = f"node {node}; " if node is not None else ""
    return (f"host {addr} ({where}rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
            f"{', '.join(labels.get(r, '?') for r in ranks)})")


def departures(old: dict[int, dict[str, Any]], new: dict[int, dict[str, Any]], replaced_at: float,
               stale_after: float, labels: dict[int, str]) -> tuple[list[HostLeft], list[str]]:
    """The hosts of the old start missing from the new one, each judged cut off or lost, and the hosts that
    joined (addresses)."""
    before, after = hosts_of(old), hosts_of(new)
    joined = sorted(set(after) - set(before))
    left = []
    for addr in sorted(set(before) - set(after)):
        ranks = before[addr]
        last = max(old[r]["time"] for r in ranks)
        node = old[ranks[0]].get("node")
        gap = replaced_at - last
        who = host_text(addr, ranks, labels, node)
        by = f", replaced by {', '.join(joined)}" if joined else ""
        if gap <= stale_after:
            verdict = "cut off"
            message = (f"{who} left the job{by}: its ranks were alive until the new start began (last beat "
                       f"{max(gap, 0.0):.1f} s before it) but the host dropped out of the rendezvous: its network")
        else:
            verdict = "lost"
            message = (f"{who} left the job{by}: its ranks stopped beating {gap:.1f} s before the new start "
                       f"began: the host is lost (down, or cut off from the network and the shared file system)")
        left.append(HostLeft(addr, node, ranks, verdict, last, replaced_at, message))
    return left, joined


def whole_hosts(ranks: list[int], beats: dict[int, dict[str, Any]], labels: dict[int, str]) -> list[str]:
    """The hosts every rank of which is among `ranks` (e.g. the ranks whose heartbeat stopped), described."""
    chosen = set(ranks)
    out = []
    for addr, members in hosts_of(beats).items():
        if set(members) <= chosen:
            out.append(host_text(addr, members, labels, beats[members[0]].get("node")))
    return out
