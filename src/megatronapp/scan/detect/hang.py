"""Hang attribution: from the ops each rank had opened and never finished, name the rank everyone waits for.

The tracer writes every comm op when it is opened (a `dur = -1` record), and flushes on a timer, on SIGTERM and
on SIGUSR1, so a job that hung and was killed leaves its in-flight ops on disk. An op opened and never closed is
in flight. For a collective (group, sequence number), the members that never opened that instance are the ones
the others wait for; for a receive, it is the sender, if it never opened the matching send. Following "waits
for" from the stuck ranks ends at a rank that is not stuck in any comm op (it hangs in its own code: a dead
loop, a deadlock, a device that stopped), or at an instance every member opened (the hang is inside the
collective: a link or the library), which is named by its group.

`flight_snapshots` turns the same trace files into the engine flight recorder's snapshot format
(`parallel/flight_recorder.py`: open ops, per-stream issued/completed seq), so the resilience supervisor's
attribution reads a MegaScan trace of any job, engine or not, with one record format.
"""
from __future__ import annotations

import numpy as np

from megatronapp.parallel.flight_recorder import stream_key
from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.read.format import CAT_INDEX, RankTrace

_COMM = CAT_INDEX["comm"]


def _key(t: RankTrace, cols: dict, i: int) -> tuple:
    """(op name, group name, group ranks, seq, sender, receiver) of row i of `cols` on rank t."""
    g = int(cols["gid"][i])
    gname, granks = t.groups[g] if g >= 0 else ("", ())
    peer = int(cols["peer"][i])
    name = t.names[int(cols["name"][i])]
    src, dst = (t.rank, peer) if name == "send" else (peer, t.rank) if name == "recv" else (-1, -1)
    return name, gname, tuple(granks), int(cols["seq"][i]), src, dst


def in_flight(traces: list[RankTrace]) -> dict[int, list[tuple]]:
    """Per rank: comm ops opened and never closed, oldest first, as (key, opened-at ns) with `_key` keys."""
    out: dict[int, list[tuple]] = {}
    for t in traces:
        op = t.opened
        if not op or not len(op.get("ts", ())):
            continue
        cols = {c: np.asarray(getattr(t, c)) for c in ("name", "gid", "seq", "peer", "cat")}
        done = {_key(t, cols, i) for i in np.flatnonzero(cols["cat"] == _COMM)}
        stuck = []
        for i in np.argsort(op["ts"], kind="stable"):
            if int(op["cat"][i]) != _COMM:
                continue
            k = _key(t, op, i)
            if k not in done:
                stuck.append((k, int(op["ts"][i])))
        if stuck:
            out[t.rank] = stuck
    return out


def _opened_anything(traces: list[RankTrace]) -> dict[int, set]:
    """Per rank: every comm op key it opened (finished or not)."""
    seen: dict[int, set] = {}
    for t in traces:
        keys = set()
        for cols in (t.opened, {c: getattr(t, c) for c in ("name", "gid", "seq", "peer", "cat")}):
            if not cols or not len(cols.get("cat", ())):
                continue
            for i in np.flatnonzero(np.asarray(cols["cat"]) == _COMM):
                keys.add(_key(t, cols, i))
        seen[t.rank] = keys
    return seen


def hang_findings(traces: list[RankTrace], partial: bool = False) -> list[Finding]:
    """`hang` findings: the rank(s) the stuck ranks wait for, and the op they wait in.

    `partial`: the traces are a selection of the job's ranks (two-level detection), so a rank without a trace here
    is unknown, not one that never opened the op: it is never blamed (a missing rank file of a whole job still is)."""
    stuck = in_flight(traces)
    if not stuck:
        return []
    opened = _opened_anything(traces)
    coords = {t.rank: t.coord for t in traces}
    waits_for: dict[int, tuple[set, tuple]] = {}
    unknown: set[int] = set()
    closed = {t.rank: {_key(t, c, i) for i in np.flatnonzero(c["cat"] == _COMM)}
              for t in traces for c in [{k: np.asarray(getattr(t, k)) for k in ("name", "gid", "seq", "peer", "cat")}]}

    def delivered(key: tuple) -> bool:  # a receive posted ahead whose send already completed: data waiting
        name, gname, granks, seq, src, dst = key
        return name == "recv" and ("send", gname, granks, seq, src, dst) in closed.get(src, set())

    for r, ops in stuck.items():
        # The op the rank is blocked in: a collective it entered after posting its receives (it got past them:
        # they were posted ahead), else the oldest op in flight, skipping receives posted ahead whose data was
        # already sent (their completion is noted when the rank gets to them).
        newest = ops[-1][0]
        key = newest if newest[0] not in ("send", "recv") else \
            next((k for k, _ in ops if not delivered(k)), ops[0][0])
        name, gname, granks, seq, src, dst = key
        if name == "recv":
            missing = {src} if ("send", gname, granks, seq, src, dst) not in opened.get(src, set()) else set()
        elif name == "send":
            missing = {dst} if ("recv", gname, granks, seq, src, dst) not in opened.get(dst, set()) else set()
        else:
            missing = {m for m in granks if m != r and key not in opened.get(m, set())}
        if partial and any(m not in opened for m in missing):
            unknown.add(r)  # it may wait for a rank not read: neither a root nor proof of a hang inside the op
            missing = {m for m in missing if m in opened}
        waits_for[r] = (missing, key)
    ahead_of_time = _break_link_cycles(waits_for)
    # Roots: waited for by someone, and not themselves stuck in a comm op waiting for another rank.
    blamed: dict[int, list[int]] = {}
    for r, (missing, _) in waits_for.items():
        for m in missing:
            if not waits_for.get(m, (set(),))[0] and m not in unknown:
                blamed.setdefault(m, []).append(r)
    if not blamed:
        blamed = _cycle_root(waits_for, opened)
    out = []
    for root, victims in sorted(blamed.items(), key=lambda kv: -len(kv[1])):
        key = waits_for[victims[0]][1]
        if root in ahead_of_time:
            k = waits_for[root][1]
            where = (f"waiting only in {k[0]} on {k[1]} (seq {k[3]}), posted ahead for a later microbatch than the "
                     "one it owes (stopped in its own work)")
        elif root not in stuck:
            where = "not in any communication (hung in its own work)"
        else:
            where = f"itself in {stuck[root][0][0][0]} on {stuck[root][0][0][1]}"
        out.append(_finding(root, coords, victims, key, f"{len(victims)} rank(s) wait for it in "
                            f"{key[0]} on group {key[1]} (seq {key[3]}); it is {where}"))
    inside = [r for r, (missing, _) in waits_for.items() if not missing and r not in unknown]
    if inside and not out:
        key = waits_for[inside[0]][1]
        members = tuple(sorted(key[2])) or tuple(sorted(inside))
        out.append(Finding("hang", members, [_coord(coords, m) for m in members],
                           f"every member opened {key[0]} on group {key[1]} (seq {key[3]}) and none finished: "
                           "the hang is inside the collective (a link or the communication library)",
                           1.0, 0.0, 0.8, {"op": _op(key), "stuck_ranks": sorted(inside)}))
    return out


def _break_link_cycles(waits_for: dict[int, tuple[set, tuple]]) -> set[int]:
    """Two ranks that each wait for the other over their P2P link: a pipeline posts receives ahead (the next
    microbatch's activation, a gradient), so a rank that stopped in its own work still shows a receive its peer
    never sent, and its peer waits for what it never sent. The channels of one link number the same microbatch
    alike (activation k and its gradient share seq k), so, as Flight Recorder takes the lowest sequence number, the
    older microbatch decides: the rank that owes it is the root and waits for no one. Returns those ranks."""
    freed = set()
    for r, (missing, key) in list(waits_for.items()):
        if len(missing) != 1 or key[0] not in ("send", "recv"):
            continue
        m = next(iter(missing))
        m_missing, m_key = waits_for.get(m, (set(), ()))
        if m_missing != {r} or not m_key or m_key[0] not in ("send", "recv") or key[3] >= m_key[3]:
            continue
        waits_for[m] = (set(), m_key)  # r waits for microbatch key[3] from m, older than what m waits for
        freed.add(m)
    return freed


def _cycle_root(waits_for: dict[int, tuple[set, tuple]], opened: dict[int, set]) -> dict[int, list[int]]:
    """When every waited-for rank waits itself (a cycle), drop the waits in receives posted ahead of time: a
    pipeline posts the GRADIENT receive of a microbatch before it sends that microbatch's activation, which the
    gradient depends on, so a rank waiting in such a receive whose activation it never sent is not blocked by
    its peer: it stopped before sending. The ranks left waiting for nobody are the roots."""
    def ahead(r: int, key: tuple) -> bool:
        name, gname, granks, seq, src, _ = key
        if name != "recv" or "grad" not in gname:
            return False
        # The activation this gradient answers: the same microbatch number, the opposite channel and direction.
        act = gname.replace("grad", "act").replace(".down", ".UP").replace(".up", ".down").replace(".UP", ".up")
        return ("send", act, granks, seq, r, src) not in opened.get(r, set())
    blamed: dict[int, list[int]] = {}
    for r, (missing, key) in waits_for.items():
        if ahead(r, key):
            continue
        for m in missing:
            m_missing, m_key = waits_for.get(m, (set(), ()))
            if not m_missing or ahead(m, m_key):
                blamed.setdefault(m, []).append(r)
    return blamed


def _coord(coords: dict, r: int) -> dict:
    dp, pp, tp = coords.get(r, (-1, -1, -1))
    return {"rank": int(r), "dp": int(dp), "pp": int(pp), "tp": int(tp)}


def _op(key: tuple) -> dict:
    name, gname, granks, seq, src, dst = key
    return {"name": name, "group": gname, "group_ranks": list(granks), "seq": seq,
            **({"src": src, "dst": dst} if src >= 0 else {})}


def _finding(root: int, coords: dict, victims: list[int], key: tuple, text: str) -> Finding:
    return Finding("hang", (int(root),), [_coord(coords, root)], text, 1.0, 0.0, 0.95,
                   {"op": _op(key), "waiting_ranks": sorted(victims)})


def flight_snapshots(traces: list[RankTrace]) -> dict[int, dict]:
    """Per rank, a flight-recorder snapshot ({"open", "recent", "issued", "completed"}) from its trace file."""
    out = {}
    for t in traces:
        stuck = {k for k, _ in in_flight([t]).get(t.rank, [])}
        snap: dict = {"open": [], "recent": [], "issued": {}, "completed": {}}
        for cols, closed in ((t.opened, False), ({c: getattr(t, c) for c in ("name", "gid", "seq", "peer", "cat",
                                                                              "ts", "nbytes")}, True)):
            if not cols or not len(cols.get("cat", ())):
                continue
            for i in np.flatnonzero(np.asarray(cols["cat"]) == _COMM):
                k = _key(t, cols, i)
                name, gname, granks, seq, src, dst = k
                if seq < 0:
                    continue
                peer = None if src < 0 else (dst if name == "send" else src)
                key = stream_key(name, gname, granks, peer, t.rank)
                snap["issued"][key] = max(snap["issued"].get(key, -1), seq)
                if closed:
                    snap["completed"][key] = max(snap["completed"].get(key, -1), seq)
                elif k in stuck:
                    snap["open"].append({"id": len(snap["open"]), "op": name, "group": gname, "ranks": list(granks),
                                         "seq": seq, "peer": peer, "bytes": int(cols["nbytes"][i]), "key": key,
                                         "t_issue": _wall_s(t, int(cols["ts"][i])), "t_done": None})
        out[t.rank] = snap
    return out


def _wall_s(t: RankTrace, ts: int) -> float | None:
    """A trace time as wall-clock seconds (the flight recorder's unit), from the header's clock pair."""
    h = t.header
    if "wall_ns" not in h or "mono_ns" not in h:
        return None
    return (ts - int(h["mono_ns"]) + int(h["wall_ns"])) / 1e9
