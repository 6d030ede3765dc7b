"""PyTorch profiler (Kineto) traces in: a directory of `torch.profiler` Chrome JSON files read as rank traces.

What users who profile their jobs already hold: one or more `*.json` / `*.json.gz` files per rank (one per
profiling window), each with `distributedInfo` (rank, world_size, process groups). Mapped onto MegaScan's spans:

- steps: `ProfilerStep#N` annotations; every other event belongs to the step whose window holds its start.
- communication: on a GPU trace the NCCL kernels (device time; their args name the collective, the element
  count and dtype, the process group and its ranks); on a CPU trace the `gloo:*` / `nccl:*` record_function
  annotations, which gloo runs on its worker threads for the whole collective (waiting for the last member
  included). Instances are numbered per process group in each step, or by the `Seq` arg where the trace has one,
  so the same collective has the same number on every rank. Point-to-point ops have no peer in these args:
  they count as communication time but are not matched as links.
- compute: on a GPU trace every other kernel and memcpy; on a CPU trace the outermost op of each thread
  (`Optimizer.*` as optimizer, DataLoader iterations as data), nested ops are inside it, less the waits: the
  stretches where the thread runs no op (an annotation such as `FSDP::all_gather` or a loop's `backward` with
  nothing running inside it, or a collective's launch) while a collective is in flight. The ops of a
  collective's worker thread (gloo's copies) are the collective's, not the rank's work.
Every rank is one data-parallel replica of one stage (coord (rank, 0, 0)): Kineto records no TP/PP layout.
Nothing in a file decides what code runs: it is parsed as JSON (`kineto_load.py`: sizes and the world bounded
before memory is spent) and read as numbers and names. Times, durations, step and sequence numbers, sizes and
group ranks are range-checked here. A file that fails a check is skipped and named (a rank whose events fail, with
the file and the field), and the rest of the directory is read.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from megatronapp.files import short
from megatronapp.scan.read.format import CAT_INDEX, RankTrace
from megatronapp.scan.read.kineto_load import MAX_BYTES, KinetoError, is_int, kineto_files, load

__all__ = ["KinetoError", "MAX_BYTES", "kineto_files", "load", "read_kineto_dir", "to_rank_trace"]
_MAX_US = float(1 << 52)  # µs (142 years): no profiler's time or duration; in ns it fits int64 with room
_MAX_STEP = (1 << 31) - 1  # iteration numbers are int32 columns
_MAX_COUNT = 1 << 48  # elements or bytes of one collective
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COMM_ANNOTATION = re.compile(r"^(?:nccl|gloo|mpi|ucc|xccl):(\w+)$")
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# CPU events that are no computation of their own: a collective's launch or wait, an annotation, Python code
_NOT_OP = re.compile(r"^(?:c10d::|_c10d_functional::|c10d_functional::|record_param_comms$)|wait")
_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
                "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "int8": 1,
                "byte": 1, "uint8": 1, "bool": 1}
_SEQ_STRIDE = 1_000_000  # instance number = step * stride + order in the step (where the trace has no Seq)


def read_kineto_dir(path: str | Path, max_bytes: int = MAX_BYTES) -> tuple[list[RankTrace], list[str]]:
    """Read every profiler trace of a directory: traces sorted by rank (several files of one rank merged), plus
    problems naming the files skipped and the ranks missing."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory {d} does not exist")
    per_rank: dict[int, list[tuple[Path, dict]]] = {}
    problems: list[str] = []
    world = 0
    for f in kineto_files(d):
        try:
            doc = load(f, max_bytes)
        except KinetoError as e:
            problems.append(str(e))
            continue
        info = doc["distributedInfo"]
        if world and info["world_size"] != world:
            problems.append(f"{f.name}: world_size {info['world_size']}, other files {world}; skipped")
            continue
        world = info["world_size"]
        per_rank.setdefault(info["rank"], []).append((f, doc))
    traces = []
    for rank, docs in sorted(per_rank.items()):
        try:
            traces.append(to_rank_trace(rank, world, docs))
        except KinetoError as e:
            problems.append(str(e))
    missing = [r for r in range(world) if r not in per_rank]
    if missing:
        problems.append(f"no profiler trace for ranks {missing[:20]}" + (f" and {len(missing) - 20} more"
                                                                          if len(missing) > 20 else ""))
    if not traces and not problems:
        problems.append(f"no profiler traces (*.json, *.json.gz) in {d}")
    return traces, problems


def _nbytes(args: dict) -> int:
    """Payload bytes from a collective's args: element count x dtype size (NCCL args), else the input dims
    (KinetoError past _MAX_COUNT: a count no collective has)."""
    n = args.get("In msg nelems")
    size = _DTYPE_BYTES.get(str(args.get("dtype", "float"))[:20].lower(), 4)
    if isinstance(n, (int, float)) and n >= 0:
        if not n < _MAX_COUNT:  # NaN is not >= 0; infinity and 1e30 stop here
            raise KinetoError(f"args 'In msg nelems' = {short(n, 30)}")
        return int(n) * size
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and all(is_int(x) for x in dims[0]):
        t = types[0] if isinstance(types, list) and types else "float"
        n = math.prod(dims[0])
        if not 0 <= n < _MAX_COUNT:
            raise KinetoError(f"args 'Input Dims' = {short(dims[0], 60)}")
        return n * _DTYPE_BYTES.get(str(t)[:20].lower(), 4)
    return 0


def _ranks(ranks: object, world: int) -> tuple[int, ...] | None:
    """Member ranks of a process group, each a rank of the world; None when they are not."""
    if isinstance(ranks, list) and ranks and all(is_int(r) and 0 <= r < world for r in ranks):
        return tuple(ranks)
    return None


def _group(args: dict, pgs: dict[str, tuple[int, ...]], world: int) -> tuple[str, tuple[int, ...]] | None:
    """(group name, member ranks) of a collective: its args, else the trace's only process group."""
    name = args.get("Process Group Name")
    name = name[:120] if isinstance(name, str) else None  # as pg_config's names are kept
    ranks = args.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks[:1 << 24])
        except (json.JSONDecodeError, RecursionError):
            ranks = None
    ranks = _ranks(ranks, world)
    if isinstance(name, str) and ranks:
        return f"pg{name}", ranks
    if isinstance(name, str) and name in pgs:
        return f"pg{name}", pgs[name]
    if len(pgs) == 1:
        (n, r), = pgs.items()
        return f"pg{n}", r
    return None  # several groups and no name: counted as communication, matched with nothing


def _outermost(ts: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """Mask of events not inside another event of the same thread."""
    o = np.lexsort((-end, ts, thread))
    keep = np.zeros(len(ts), bool)
    cur_thread, cur_end = None, -np.inf
    for i in o.tolist():
        if thread[i] != cur_thread or ts[i] >= cur_end:
            keep[i] = True
            cur_thread, cur_end = thread[i], end[i]
        else:
            cur_end = max(cur_end, end[i])  # overlapping without nesting: taken as part of the outer one
    return keep


def _idle(ts: np.ndarray, end: np.ndarray, thread: np.ndarray, is_op: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the stretches of each thread's time whose innermost event is no op: an annotation
    (`FSDP::all_gather`, a loop's `backward`), a Python function or a collective's launch, with nothing running
    inside it. A thread blocked in a collective's wait shows so (the wait itself records no op); its compute
    shows as ops (`aten::mm`, an autograd node's own code) however slow they run."""
    o = np.lexsort((-end, ts, thread))
    out_s: list[int] = []
    out_e: list[int] = []
    stack: list[tuple[int, bool]] = []  # (end, is_op) of the open events, outermost first
    cur_thread, cursor = None, 0

    def advance(to: int) -> None:
        nonlocal cursor
        while stack and stack[-1][0] <= to:
            e, op = stack.pop()
            if not op and e > cursor:
                out_s.append(cursor)
                out_e.append(e)
            cursor = max(cursor, e)
        if stack and not stack[-1][1] and to > cursor:
            out_s.append(cursor)
            out_e.append(to)
        cursor = max(cursor, to)

    for i in o.tolist():
        if thread[i] != cur_thread:
            advance(np.iinfo(np.int64).max)
            cur_thread, cursor = thread[i], int(ts[i])
        advance(int(ts[i]))
        e = int(end[i])
        if stack:
            e = min(e, stack[-1][0])  # overlapping without nesting: cut at the enclosing event's end
        stack.append((e, bool(is_op[i])))
    advance(np.iinfo(np.int64).max)
    return np.array(out_s, np.int64), np.array(out_e, np.int64)


def _covered(ws: np.ndarray, we: np.ndarray, cs: np.ndarray, ce: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of the spans [ws, we) covered by the union of the spans [cs, ce): (start, end)."""
    if not len(cs) or not len(ws):
        z = np.zeros(0, np.int64)
        return z, z
    o = np.argsort(cs, kind="stable")
    cs, ce = cs[o], np.maximum.accumulate(ce[o])
    new = np.r_[True, cs[1:] > ce[:-1]]  # union intervals: a start past every earlier end
    us, ue = cs[new], np.r_[ce[np.flatnonzero(new)[1:] - 1], ce[-1]]
    first = np.searchsorted(ue, ws, side="right")
    last = np.searchsorted(us, we, side="left")
    idx = np.repeat(np.arange(len(ws)), np.maximum(last - first, 0))
    u = np.concatenate([np.arange(a, b) for a, b in zip(first, last) if b > a]) if len(idx) else idx
    s, e = np.maximum(us[u], ws[idx]), np.minimum(ue[u], we[idx])
    return s[e > s], e[e > s]


def to_rank_trace(rank: int, world: int, docs: list[tuple[Path, dict]]) -> RankTrace:
    """One rank's spans from its profiler trace files (events of several files merged)."""
    pgs: dict[str, tuple[int, ...]] = {}
    for _, doc in docs:
        configs = doc["distributedInfo"].get("pg_config")
        for pg in configs if isinstance(configs, list) else []:
            members = _ranks(pg.get("ranks"), world) if isinstance(pg, dict) else None
            if members:
                pgs[str(pg.get("pg_name"))[:120]] = members
    events = [(p, e) for p, doc in docs for e in doc["traceEvents"]
              if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
              and isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0 and isinstance(e.get("name"), str)]
    if not events:
        raise KinetoError(f"rank {rank} ({', '.join(p.name for p, _ in docs)}): no complete events; skipped")
    device = any(e.get("cat") in _DEVICE_CATS for _, e in events)

    def bad(path: Path, e: dict, field: str) -> KinetoError:  # an event out of range: the file and the field
        return KinetoError(f"rank {rank}: {path.name}: an event ({short(e.get('name'), 60)!r}) has {field}; the "
                           f"rank is skipped")

    names: dict[str, int] = {}
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    rows: list[tuple] = []  # (ts_ns, dur_ns, cat, name id, gid, nbytes, seq arg, thread key, is an op)
    steps: list[tuple[int, int, int]] = []
    step_threads: set[str] = set()
    for path, e in events:
        name, cat, args = e["name"], e.get("cat"), e.get("args") if isinstance(e.get("args"), dict) else {}
        if not -_MAX_US < e["ts"] < _MAX_US:  # NaN, Infinity and 1e17 fail here
            raise bad(path, e, f"'ts' = {short(e['ts'], 30)}: not a time in µs")
        if not e["dur"] < _MAX_US:
            raise bad(path, e, f"'dur' = {short(e['dur'], 30)}: not a duration in µs")
        ts, dur = int(round(e["ts"] * 1000)), int(round(e["dur"] * 1000))
        thread = f"{e.get('pid')}/{e.get('tid')}"[:200]
        m = _STEP.match(name)
        if m and cat in ("user_annotation", "cpu_op"):
            if len(m.group(1)) > 10 or int(m.group(1)) > _MAX_STEP:
                raise bad(path, e, f"a step number above {_MAX_STEP}")
            steps.append((ts, ts + dur, int(m.group(1))))
            step_threads.add(thread)
            continue
        op, kind = None, None
        if device:
            km = _NCCL_KERNEL.match(name) if cat == "kernel" else None
            if km:
                op, kind = str(args.get("Collective name") or km.group(1)).lower(), "comm"
            elif cat in _DEVICE_CATS:
                op, kind = name.split("(")[0][:120], "compute"
            # CPU ops of a GPU job: launches and enqueues; the device timeline holds the time
        else:
            cm = _COMM_ANNOTATION.match(name) if cat in ("user_annotation", "cpu_op") else None
            if cm:
                op, kind = cm.group(1), "comm"
            elif cat in ("cpu_op", "user_annotation", "python_function"):
                kind = "optimizer" if name.startswith("Optimizer.") else \
                    "data" if "DataLoader" in name else "compute"
                op = name.split("#")[0][:120]
        if kind is None:
            continue
        gid, nbytes, seq = -1, 0, -1
        if kind == "comm":
            g = _group(args, pgs, world)
            gid = groups.setdefault(g, len(groups)) if g else -1
            try:
                nbytes = _nbytes(args)
            except KinetoError as why:
                raise bad(path, e, str(why)) from None
            seq = args.get("Seq")
            if is_int(seq) and not 0 <= seq < _MAX_COUNT:
                raise bad(path, e, f"args 'Seq' = {short(seq, 30)}: not a sequence number")
            seq = seq if is_int(seq) else -1
        is_op = cat == "cpu_op" and not _NOT_OP.search(name)
        rows.append((ts, dur, CAT_INDEX[kind], names.setdefault(op, len(names)), gid, nbytes, seq, thread, is_op))
    if not steps:
        raise KinetoError(f"rank {rank} ({', '.join(p.name for p, _ in docs)}): no ProfilerStep#N annotations "
                          "(profile with a schedule and call prof.step() each iteration); skipped")
    steps.sort()
    ts = np.array([r[0] for r in rows], np.int64)
    dur = np.array([r[1] for r in rows], np.int64)
    cat = np.array([r[2] for r in rows], np.int8)
    name = np.array([r[3] for r in rows], np.int32)
    gid = np.array([r[4] for r in rows], np.int32)
    nbytes = np.array([r[5] for r in rows], np.int64)
    seq = np.array([r[6] for r in rows], np.int64)
    is_op = np.array([r[8] for r in rows], bool)
    thread_key = np.array([r[7] for r in rows], object)
    thread = np.unique(thread_key, return_inverse=True)[1].ravel() if rows else np.zeros(0, np.int64)
    comm = cat == CAT_INDEX["comm"]
    # Work spans: the outermost of each thread (nested ops are part of it); comm spans all kept. The ops on a
    # collective's worker thread (gloo runs each collective there: a thread with collectives and no profiler
    # step) are the collective's own (copies, the average of a reduce-scatter), no work of the rank.
    keep = comm.copy()
    workers = set(thread_key[comm].tolist()) - step_threads
    work = ~comm & ~np.isin(thread_key, list(workers)) if workers else ~comm
    keep[work] = _outermost(ts[work], ts[work] + dur[work], thread[work])
    s_ts = np.array([s[0] for s in steps], np.int64)
    s_end = np.array([s[1] for s in steps], np.int64)
    s_n = np.array([s[2] for s in steps], np.int64)
    k = np.searchsorted(s_ts, ts, side="right") - 1
    inside = (k >= 0) & (ts < s_end[np.maximum(k, 0)])
    it = np.where(inside, s_n[np.maximum(k, 0)], -1)
    if (seq < 0).any():
        # Number each group's collectives in each step by start: the same order on every rank of the group.
        c = np.flatnonzero(comm & (gid >= 0) & (it >= 0))
        o = c[np.lexsort((ts[c], it[c], gid[c]))]
        key = gid[o].astype(np.int64) * (1 << 32) + it[o]
        first = np.r_[True, key[1:] != key[:-1]] if len(o) else np.zeros(0, bool)
        start = np.maximum.accumulate(np.where(first, np.arange(len(o)), 0)) if len(o) else o
        seq[o] = it[o] * _SEQ_STRIDE + (np.arange(len(o)) - start)
    sel = np.flatnonzero(keep)
    if not device:
        # A thread that waits for a collective (FSDP's pre-forward for its all-gather, DDP's end of backward for
        # its all-reduce) records no op while it waits: gloo runs the collective on a worker thread, the waiting
        # thread sits in an annotation with nothing inside it. Those stretches, where a collective is in flight,
        # are copied as comm spans inside the work span ("in flight"), which its exclusive time leaves out: a rank
        # waiting for a slow peer is not itself slow, while a slow rank's ops (however named) stay its compute.
        # (The table nests a comm span in the latest work span started before it: right for one working thread,
        # the training loop's; a second thread's spans starting between would take the wait from it.)
        w = np.flatnonzero(work)
        ids, ide = _idle(ts[w], ts[w] + dur[w], thread[w], is_op[w])
        wts, wend = _covered(ids, ide, ts[comm], ts[comm] + dur[comm])
        if len(wts):
            fid = names.setdefault("in flight", len(names))
            k = len(ts)
            ks = np.searchsorted(s_ts, wts, side="right") - 1
            wit = np.where((ks >= 0) & (wts < s_end[np.maximum(ks, 0)]), s_n[np.maximum(ks, 0)], -1)
            ts, dur = np.r_[ts, wts], np.r_[dur, wend - wts]
            cat = np.r_[cat, np.full(len(wts), CAT_INDEX["comm"], np.int8)]
            name = np.r_[name, np.full(len(wts), fid, np.int32)]
            gid, nbytes = np.r_[gid, np.full(len(wts), -1, np.int32)], np.r_[nbytes, np.zeros(len(wts), np.int64)]
            seq, it = np.r_[seq, np.full(len(wts), -1, np.int64)], np.r_[it, wit]
            sel = np.r_[sel, np.arange(k, k + len(wts))]
    step_cols = {"ts": s_ts, "dur": s_end - s_ts, "it": s_n}
    n_step = len(steps)
    step_name = names.setdefault("step", len(names))
    cols = {
        "ts": np.r_[ts[sel], step_cols["ts"]], "dur": np.r_[dur[sel], step_cols["dur"]],
        "cat": np.r_[cat[sel], np.full(n_step, CAT_INDEX["step"], np.int8)],
        "name": np.r_[name[sel], np.full(n_step, step_name, np.int32)],
        "it": np.r_[it[sel], step_cols["it"]].astype(np.int32),
        "gid": np.r_[gid[sel], np.full(n_step, -1, np.int32)],
        "seq": np.r_[seq[sel], np.full(n_step, -1, np.int64)],
        "nbytes": np.r_[nbytes[sel], np.zeros(n_step, np.int64)],
    }
    n = len(cols["ts"])
    cols.update(peer=np.full(n, -1, np.int32), mb=np.full(n, -1, np.int32), chunk=np.full(n, -1, np.int16),
                cpu_wait=np.full(n, -1, np.int64))
    # By time; at one instant a work span before the comm inside it (nesting is read from the order).
    order = np.lexsort((cols["cat"] == CAT_INDEX["comm"], cols["ts"]))
    cols = {c: v[order] for c, v in cols.items()}
    doc0 = docs[0][1]
    header = {"rank": rank, "world": world, "coord": [rank, 0, 0], "topo": [1, 1, world], "source": "kineto",
              "files": [p.name for p, _ in docs], "host": doc0.get("host_name"),
              "backend": doc0["distributedInfo"].get("backend"), "device": device}
    return RankTrace(rank=rank, world=world, coord=(rank, 0, 0), topo=(1, 1, world), header=header,
                     names=list(names), groups=list(groups), **cols)
