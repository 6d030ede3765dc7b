"""A GPU job's profiler trace read as a rank trace: the device timeline, its NCCL kernels keyed for matching.

On a GPU the host only launches work; what takes time runs on the device. So the spans of a rank are its device
events (`kernel`, `gpu_memcpy`, `gpu_memset`): an NCCL kernel is a collective or a point-to-point transfer (its
duration holds the wait for the last peer, which detection splits out by matching instances across ranks), every
other event is the rank's compute. An event belongs to the iteration its launch was issued in (the
`cuda_runtime` launch with the same `correlation`, inside a `ProfilerStep#N`), and an iteration's span on the device
runs from its first event's start to its last event's end; where the device sat idle in between, the host was late
or the device waited on something no kernel shows.

What ties an NCCL kernel to its peers' (kineto_fields.py for the fields): the kernel's args, or those of the
`record_param_comms` op that launched it (same `External id`): collective name, process group, `Seq` (the group's
sequence number, where PyTorch records it; else the order of the group's calls in each step, the same on every
rank, which detection checks by name and size), and for a point-to-point op its direction and peer (`Src Rank` /
`Dst Rank`). A send or receive is numbered by its order on its (group, sender, receiver) in each step.

Host or device late: for each idle stretch of the device, the part before the next event's launch returned is
time the device waited for the host (`host_idle_ms` per iteration in the header); the rest it waited on itself.

Hangs: a collective launched (its `record_param_comms` op and the launch call are in the trace) whose kernel never
finished has no device event: it is an op opened and never closed (`RankTrace.opened`), as the tracer writes them.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from megatronapp.scan.read.format import CAT_INDEX, COLUMNS, RankTrace
from megatronapp.scan.read.kineto_fields import (
    NAME_CHARS,
    SEQ_STRIDE,
    as_int,
    bad_event,
    check_times,
    group_of,
    nbytes,
    pg_configs,
    seq_of,
    step_number,
)
from megatronapp.scan.read.kineto_load import KinetoError

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_KERNEL_LAUNCH = re.compile(r"^(?:cuda|cu)LaunchKernel")  # not the event records and stream waits around it
_P2P = {"send", "recv"}
_NAME_CHARS = 300  # a kernel's name up to its argument list, cut here (template names run to thousands)


def is_device_trace(events: list[dict]) -> bool:
    """Whether a trace has device events (a GPU job)."""
    return any(isinstance(e, dict) and e.get("cat") in DEVICE_CATS for e in events)


@functools.lru_cache(maxsize=4096)  # a trace runs a few hundred kernels, each thousands of times
def kernel_name(full: str) -> str:
    """A device event's name without its argument list (`void f<T>(int, float*)` -> `f<T>`; `Memcpy HtoD (Pinned
    -> Device)` -> `Memcpy HtoD`): one name per kernel whatever it was called with. `(anonymous namespace)` and
    lambdas inside template arguments are parts of the name, not its arguments."""
    s = full.replace("(anonymous namespace)", "\0")
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif ch == "(" and depth == 0 and i:
            s = s[:i]
            break
    s = s.replace("\0", "(anonymous namespace)").strip()
    return (s[5:] if s.startswith("void ") else s)[:_NAME_CHARS]


def _nccl_args(e: dict, by_ext: dict[int, dict]) -> dict:
    """An NCCL kernel's collective fields: its own args, completed by those of the record_param_comms op that
    launched it (older Kinetos copy only some fields onto the kernel)."""
    args = e.get("args") if isinstance(e.get("args"), dict) else {}
    op = by_ext.get(as_int(args.get("External id")) or -1)
    return {**op, **args} if op else args


def _op(name: str, args: dict) -> str:
    """The collective's name: `Collective name` where recorded, else the kernel's (AllReduce -> allreduce)."""
    coll = args.get("Collective name")
    if isinstance(coll, str) and coll:
        return coll[:NAME_CHARS].lower()
    m = NCCL_KERNEL.match(name)
    return m.group(1).lower() if m else "nccl"


def _peer(op: str, args: dict, world: int) -> int:
    """The other end of a point-to-point op (a global rank), -1 where the trace does not say or names a rank
    outside the world."""
    p = as_int(args.get("Dst Rank" if op == "send" else "Src Rank")) if op in _P2P else None
    return p if p is not None and 0 <= p < world else -1


def _counts(rank: int, path: Path, e: dict, args: dict) -> tuple[int, int]:
    """(payload bytes, Seq or -1) of a collective's args; KinetoError naming the rank, file and field where one
    is out of range (kineto_fields' bounds, as on the CPU path)."""
    try:
        return nbytes(args), seq_of(args)
    except KinetoError as why:
        raise bad_event(rank, path, e, str(why)) from None


def gpu_rank_trace(rank: int, world: int, docs: list[tuple[Path, dict]]) -> RankTrace:
    """One rank's device spans from its profiler trace files (a GPU job's; events of several files merged)."""
    label = f"rank {rank} ({', '.join(p.name for p, _ in docs)})"
    pgs: dict = {}
    for _, doc in docs:
        pgs.update(pg_configs(doc["distributedInfo"], world))
    steps: list[tuple[int, int, int]] = []
    launches: dict[int, tuple] = {}  # correlation -> (ts, end, args, a kernel launch?) of the launch call
    by_ext: dict[int, dict] = {}  # External id -> args of record_param_comms ops
    device: list[tuple[Path, dict]] = []
    for path, doc in docs:
        for e in doc["traceEvents"]:
            if not isinstance(e, dict) or e.get("ph") != "X" or not isinstance(e.get("name"), str) or \
                    not isinstance(e.get("ts"), (int, float)) or not isinstance(e.get("dur"), (int, float)) or \
                    e["dur"] < 0:
                continue
            check_times(rank, path, e)  # every event, as on the CPU path
            cat, args = e.get("cat"), e.get("args") if isinstance(e.get("args"), dict) else {}
            ts, end = int(round(e["ts"] * 1000)), int(round((e["ts"] + e["dur"]) * 1000))
            if cat in DEVICE_CATS:
                device.append((path, e))
            elif cat in _LAUNCH_CATS and as_int(args.get("correlation")) is not None:
                launches[as_int(args["correlation"])] = (ts, end, args, bool(_KERNEL_LAUNCH.match(e["name"])))
            elif e["name"] == "record_param_comms" and as_int(args.get("External id")) is not None:
                _counts(rank, path, e, args)  # its fields are read with its kernel's, or as an opened op
                by_ext[as_int(args["External id"])] = args
            elif (number := step_number(rank, path, e)) is not None:
                steps.append((ts, end, number))
    if not steps:
        raise KinetoError(f"{label}: no ProfilerStep#N annotations (profile with a schedule and call prof.step() "
                          "each iteration); skipped")
    if not device:
        raise KinetoError(f"{label}: no device events; skipped")
    steps.sort()
    device.sort(key=lambda pe: pe[1]["ts"])  # instance numbers follow launch order: on one stream, start order
    s_ts, s_end, s_n = (np.array([s[i] for s in steps], np.int64) for i in range(3))

    def step_of(t: np.ndarray) -> np.ndarray:
        """The step whose host window holds each time; past the last step, the unfinished one after it."""
        k = np.searchsorted(s_ts, t, side="right") - 1
        inside = (k >= 0) & (t < s_end[np.maximum(k, 0)])
        after = t >= s_end[-1]
        return np.where(inside, s_n[np.maximum(k, 0)], np.where(after, s_n[-1] + 1, -1))

    names: dict[str, int] = {}
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    n = len(device)
    ts, dur = np.zeros(n, np.int64), np.zeros(n, np.int64)
    name, gid = np.zeros(n, np.int32), np.full(n, -1, np.int32)
    cat, peer = np.full(n, CAT_INDEX["compute"], np.int8), np.full(n, -1, np.int32)
    seq, size, launch_end = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    host_at = np.zeros(n, np.int64)
    for i, (path, e) in enumerate(device):
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        ts[i], dur[i] = int(round(e["ts"] * 1000)), int(round(e["dur"] * 1000))
        c = as_int(args.get("correlation"))
        launch = launches.get(c) if c is not None else None
        host_at[i], launch_end[i] = launch[:2] if launch else (ts[i], ts[i])
        if e.get("cat") == "kernel" and NCCL_KERNEL.match(e["name"]):
            full = _nccl_args(e, by_ext)
            op = _op(e["name"], full)
            size[i], s = _counts(rank, path, e, full)
            cat[i], peer[i] = CAT_INDEX["comm"], _peer(op, full, world)
            if op in _P2P and peer[i] < 0:
                op = "sendrecv"  # a point-to-point kernel whose peer the trace does not name: time, no link
            g = group_of(full, pgs, label_by_desc=True, world=world)
            gid[i] = groups.setdefault(g, len(groups)) if g else -1
            seq[i] = s if op not in _P2P else -1
        else:
            op = kernel_name(e["name"])
        name[i] = names.setdefault(op, len(names))
    it = step_of(host_at)
    opened = _opened(launches, by_ext, [e for _, e in device], names, groups, pgs, step_of, world)
    seq_source = _number(it, seq, gid, cat, peer, name, names, rank, opened)
    idle = host_idle(ts, ts + dur, launch_end, it)
    # An iteration's span on the device: from its first event's start to its last event's end.
    its = sorted(set(it[np.isin(it, s_n)].tolist()))
    st_ts = np.array([ts[it == k].min() for k in its], np.int64)
    st_end = np.array([(ts + dur)[it == k].max() for k in its], np.int64)
    step_name = names.setdefault("step", len(names))
    m = len(its)
    cols = {"ts": np.r_[ts, st_ts], "dur": np.r_[dur, st_end - st_ts],
            "cat": np.r_[cat, np.full(m, CAT_INDEX["step"], np.int8)],
            "name": np.r_[name, np.full(m, step_name, np.int32)], "it": np.r_[it, its].astype(np.int32),
            "gid": np.r_[gid, np.full(m, -1, np.int32)], "seq": np.r_[seq, np.full(m, -1, np.int64)],
            "nbytes": np.r_[size, np.zeros(m, np.int64)], "peer": np.r_[peer, np.full(m, -1, np.int32)]}
    k = len(cols["ts"])
    cols.update(mb=np.full(k, -1, np.int32), chunk=np.full(k, -1, np.int16), cpu_wait=np.full(k, -1, np.int64))
    order = np.lexsort((cols["cat"] == CAT_INDEX["comm"], cols["ts"]))
    cols = {c: v[order] for c, v in cols.items()}
    doc0 = docs[0][1]
    header = {"rank": rank, "world": world, "coord": [rank, 0, 0], "topo": [1, 1, world], "source": "kineto",
              "files": [p.name for p, _ in docs], "host": doc0.get("host_name"),
              "backend": doc0["distributedInfo"].get("backend"), "device": True, "seq_source": seq_source,
              "gpu": {"host_idle_ms": {int(k): round(v / 1e6, 4) for k, v in idle.items() if k in its}}}
    return RankTrace(rank=rank, world=world, coord=(rank, 0, 0), topo=(1, 1, world), header=header,
                     names=list(names), groups=list(groups), opened=opened, **cols)


def _opened(launches: dict, by_ext: dict, device: list[dict], names: dict, groups: dict, pgs: dict,
            step_of, world: int) -> dict[str, np.ndarray]:
    """Collectives launched whose kernel never ran to its end: the launch call of a record_param_comms op with no
    device event of its correlation. In COLUMNS, as the tracer's opened ops (their ops' fields checked as they
    were collected)."""
    done = {as_int(e["args"].get("correlation")) for e in device if isinstance(e.get("args"), dict)}
    rows = []
    for c, (t, _, args, kernel) in launches.items():
        if c in done or not kernel:
            continue
        op_args = by_ext.get(as_int(args.get("External id")) or -1)
        if not op_args:
            continue
        op = _op("", op_args)
        g = group_of(op_args, pgs, label_by_desc=True, world=world)
        s = seq_of(op_args)
        rows.append((t, names.setdefault(op, len(names)), groups.setdefault(g, len(groups)) if g else -1,
                     s if op not in _P2P else -1, _peer(op, op_args, world), nbytes(op_args)))
    out = {c: np.zeros(len(rows), np.int64) for c in COLUMNS}
    if rows:
        t = np.array([r[0] for r in rows], np.int64)
        out.update(ts=t, name=np.array([r[1] for r in rows]), gid=np.array([r[2] for r in rows]),
                   seq=np.array([r[3] for r in rows]), peer=np.array([r[4] for r in rows]),
                   nbytes=np.array([r[5] for r in rows]), it=step_of(t), dur=np.full(len(rows), -1, np.int64),
                   cat=np.full(len(rows), CAT_INDEX["comm"]), mb=np.full(len(rows), -1), chunk=np.full(len(rows), -1),
                   cpu_wait=np.full(len(rows), -1))
    return out


def _number(it: np.ndarray, seq: np.ndarray, gid: np.ndarray, cat: np.ndarray, peer: np.ndarray, name: np.ndarray,
            names: dict[str, int], rank: int, opened: dict[str, np.ndarray]) -> str:
    """Instance numbers where the trace has none (in place, finished and opened ops alike, in launch order):
    a collective by its order among its group's collectives in each step; a send or receive by its order on its
    (group, sender, receiver) in each step. Returns how collectives are numbered: "Seq" or "order"."""
    ids = {v: k for k, v in names.items()}
    n_done = len(it)
    o_it = opened.get("it", np.zeros(0, np.int64))
    a_it, a_gid = np.r_[it, o_it], np.r_[gid, opened.get("gid", np.zeros(0, np.int64))]
    a_peer = np.r_[peer, opened.get("peer", np.zeros(0, np.int64))]
    a_name = np.r_[name, opened.get("name", np.zeros(0, np.int64))]
    a_seq = np.r_[seq, opened.get("seq", np.zeros(0, np.int64))]
    a_comm = np.r_[cat == CAT_INDEX["comm"], np.ones(len(o_it), bool)]
    op = np.array([ids[int(x)] for x in a_name], object) if len(a_name) else np.zeros(0, object)
    is_p2p = np.isin(op, list(_P2P)) & (a_peer >= 0)
    src = np.where(op == "send", rank, a_peer)
    dst = np.where(op == "send", a_peer, rank)
    coll = a_comm & ~is_p2p & (a_gid >= 0) & (a_it >= 0)
    source = "Seq" if coll.any() and (a_seq[coll] >= 0).all() else "order"
    link = (a_gid.astype(np.int64) + 1) * (1 << 40) + src * (1 << 20) + dst
    for mask, key in ((coll & (a_seq < 0), a_gid.astype(np.int64)), (a_comm & is_p2p & (a_it >= 0), link)):
        c = np.flatnonzero(mask)
        if not len(c):
            continue
        # Launch order: the position in the trace (finished ops by device start, opened ones after them).
        o = c[np.lexsort((c, a_it[c], key[c]))]
        k = key[o] * (1 << 22) + a_it[o]
        first = np.r_[True, k[1:] != k[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(len(o)), 0))
        a_seq[o] = a_it[o] * SEQ_STRIDE + (np.arange(len(o)) - start)
    seq[:] = a_seq[:n_done]
    if len(o_it):
        opened["seq"] = a_seq[n_done:]
    return source


def host_idle(start: np.ndarray, end: np.ndarray, launch_end: np.ndarray, it: np.ndarray) -> dict[int, int]:
    """Per iteration: ns the device sat idle waiting for the host (the next event not yet launched), counted in
    the iteration of the event that ended the idle stretch."""
    if not len(start):
        return {}
    o = np.argsort(start, kind="stable")
    s, e, le, k = start[o], end[o], launch_end[o], it[o]
    run = np.maximum.accumulate(e)
    gap_start = np.r_[s[0], run[:-1]]
    idle = s > gap_start  # an event that starts after everything before it ended: the device was idle
    wait = np.where(idle, np.clip(le - gap_start, 0, s - gap_start), 0)
    out: dict[int, int] = {}
    for key, w in zip(k[idle].tolist(), wait[idle].tolist()):
        out[key] = out.get(key, 0) + int(w)
    return out
