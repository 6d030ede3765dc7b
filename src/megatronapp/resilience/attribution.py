"""Who is a hung job waiting for? Wait edges from the flight recorders of every rank, and the rank at their root.

A rank with an op in flight waits for the members of that op's stream that have not issued it yet (`issued` of
the stream's key below the op's `seq`): for a collective, the members that never entered it; for a receive, the
peer that never sent; for a send, the peer that never posted the receive. A member that did issue it is not
waited for (the data is on its way, or it waits itself). Following the edges leads to the ranks that wait for no
one: those are the cause, everyone else a victim. A rank that stopped beating (stopped, dead) is the cause
whatever the edges say, because its recorder is frozen. This is the analysis PyTorch's Flight Recorder tooling
does for NCCL collectives, extended to our per-channel P2P sequence numbers.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Wait:
    waiter: int
    target: int
    op: dict[str, Any]  # the waiter's flight-recorder record of the op it waits in
    why: str

    def describe(self) -> str:
        return f"waits in {op_text(self.op)} ({self.why})"


def op_text(op: dict[str, Any]) -> str:
    return f"{op['op']} {op['key']} #{op['seq']}"


def wait_edges(flights: dict[int, dict[str, Any]]) -> list[Wait]:
    """Every (waiter -> target) edge, one per pair, labelled with the waiter's oldest op that waits for it."""
    edges: dict[tuple[int, int], Wait] = {}
    for rank, flight in sorted(flights.items()):
        for op in flight.get("open", []):  # oldest first
            if op["peer"] is None:
                candidates: Iterable[int] = (m for m in op["ranks"] if m != rank)
                why = "{t} never entered it"
            else:
                candidates = (op["peer"],)
                why = "{t} never sent it" if op["op"] == "recv" else "{t} never posted the receive"
            for t in candidates:
                theirs = flights.get(t)
                if theirs is None or theirs.get("issued", {}).get(op["key"], -1) >= op["seq"]:
                    continue
                edges.setdefault((rank, t), Wait(rank, t, op, why.format(t=f"rank {t}")))
    return list(edges.values())


def culprits(flights: dict[int, dict[str, Any]], unresponsive: Iterable[int] = (),
             steps: dict[int, int] | None = None) -> list[int]:
    """The ranks the job waits for: unresponsive ones first, then those that are waited for but wait for no one;
    if the edges only form cycles, the ranks furthest behind in steps."""
    dead = sorted(set(unresponsive))
    if dead:
        return dead
    edges = wait_edges(flights)
    waiting = {e.waiter for e in edges}
    roots = sorted({e.target for e in edges} - waiting)
    if roots:
        # most waited-for first: a root that many ranks (transitively) wait for is the likelier cause
        return sorted(roots, key=lambda r: (-len(waiters_of(r, edges)), r))
    if steps:
        low = min(steps.values())
        return sorted(r for r, s in steps.items() if s == low)
    return []


def waiters_of(rank: int, edges: list[Wait]) -> set[int]:
    """Every rank that waits for `rank`, directly or through others."""
    seen: set[int] = set()
    frontier = [rank]
    while frontier:
        t = frontier.pop()
        for e in edges:
            if e.target == t and e.waiter not in seen and e.waiter != rank:
                seen.add(e.waiter)
                frontier.append(e.waiter)
    return seen


def wait_tree(roots: list[int], flights: dict[int, dict[str, Any]], labels: dict[int, str],
              notes: dict[int, str]) -> str:
    """Who waits for whom, in which op, as a tree under each root (every rank printed once)."""
    edges = wait_edges(flights)
    lines: list[str] = []
    shown: set[int] = set()

    def name(r: int) -> str:
        return f"rank {r} ({labels.get(r, '?')})"

    def children(r: int, prefix: str) -> None:
        kids = [e for e in edges if e.target == r and e.waiter not in shown]
        for i, e in enumerate(kids):
            shown.add(e.waiter)
            last = i == len(kids) - 1
            lines.append(f"{prefix}{'└── ' if last else '├── '}{name(e.waiter)} {e.describe()}")
            children(e.waiter, prefix + ("    " if last else "│   "))

    for r in roots:
        if r in shown:
            continue
        shown.add(r)
        lines.append(f"{name(r)}: {notes.get(r, 'waits for no one')}   <- the cause")
        children(r, "")
    rest = sorted(set(flights) - shown)
    for r in rest:
        theirs = [e for e in edges if e.waiter == r]
        what = theirs[0].describe() if theirs else notes.get(r, "not waiting in a communication op")
        lines.append(f"{name(r)} {what}")
    return "\n".join(lines)
