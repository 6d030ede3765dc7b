"""Synthetic MegaScan traces of a 3D-parallel job at any scale, with injected faults of known ground truth.

The job is simulated, not sampled: every rank of a (tp, pp, dp) grid runs 1F1B over `microbatches`, each
forward/backward ends in a TP all-reduce, stages exchange activations and gradients by P2P, and each iteration
ends with the DP gradient all-reduce and the optimizer. A rank starts an op when its own inputs are ready, so a
delay propagates the way it does on hardware: a slow rank makes its TP peers wait in the all-reduce, the next
stage wait in recv, and every DP replica wait at the gradient all-reduce.

Collectives are rings (group order, as NCCL's default and the engine's): healthy members leave together, a
moment after the last arrival plus the collective's cost; a slow link between two ring neighbours makes its
receiver leave last and every member after it a step earlier, its sender first (`ring_shift`), which is what
MegaScan's localisation of a slow link inside a group reads. Without a slow link the outputs are what they were.

Vectorised over the (dp, tp) plane: one numpy step per (stage, task) of the static 1F1B order, so 12,288 ranks
cost the same number of Python steps as 8. Spans are kept per stage as planes of times with their metadata once
(`_Slots`) and written a stage at a time by two threads, so 100,096 ranks x 10 iterations fit in 2.6 GB. Each
rank's clock has its own offset (files are written in local time, like real ones); the ground truth goes to
`ground_truth.json`, never into the rank files.
"""
from __future__ import annotations

import json
import stat
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megatronapp.files import write_exclusive
from megatronapp.scan.detect.features import summary_blocks
from megatronapp.scan.read.format import CAT_INDEX, RankTrace, pack_columns, rank_file, write_rank_file

FAULT_KINDS = ("slow-compute", "slow-link", "pause", "late-arrival")
MS = 1_000_000  # ns
WRITERS = 2  # threads writing rank files (this machine has 2 cores; more only queue in the kernel)


@dataclass(frozen=True)
class Fault:
    """One injected fault: `ranks` is (rank,) or the link (a, b)."""

    kind: str
    ranks: tuple[int, ...]
    factor: float = 1.0  # slow-compute / slow-link multiplier
    ms: float = 0.0  # pause length / late-arrival delay
    every: int = 1  # pause period in iterations

    def label(self) -> str:
        if self.kind == "slow-link":
            return f"slow-link {self.ranks[0]}-{self.ranks[1]} x{self.factor:g}"
        if self.kind == "slow-compute":
            return f"slow-compute {self.ranks[0]} x{self.factor:g}"
        if self.kind == "pause":
            return f"pause {self.ranks[0]} {self.ms:g} ms every {self.every}"
        return f"late-arrival {self.ranks[0]} +{self.ms:g} ms"


def parse_fault(spec: str) -> Fault:
    """Parse `slow-compute=R:F`, `slow-link=A-B[:F]`, `pause=R:MS[:EVERY]` or `late-arrival=R:MS`."""
    kind, sep, arg = spec.partition("=")
    if not sep or kind not in FAULT_KINDS:
        raise ValueError(f"--fault {spec!r}: expected KIND=ARGS with KIND one of {', '.join(FAULT_KINDS)}")
    parts = arg.split(":")
    try:
        if kind == "slow-link":
            a, b = (int(x) for x in parts[0].split("-"))
            return Fault(kind, (a, b), factor=float(parts[1]) if len(parts) > 1 else 3.0)
        rank = int(parts[0])
        if kind == "slow-compute":
            return Fault(kind, (rank,), factor=float(parts[1]) if len(parts) > 1 else 1.3)
        if kind == "pause":
            return Fault(kind, (rank,), ms=float(parts[1]), every=int(parts[2]) if len(parts) > 2 else 2)
        return Fault(kind, (rank,), ms=float(parts[1]))
    except (ValueError, IndexError):
        forms = {"slow-link": "A-B[:FACTOR]", "slow-compute": "RANK:FACTOR", "pause": "RANK:MS[:EVERY]",
                 "late-arrival": "RANK:MS"}
        raise ValueError(f"--fault {spec!r}: {kind} takes {forms[kind]}") from None


@dataclass
class Costs:
    """Nominal op costs in ms and noise levels (lognormal sigmas)."""

    forward: float = 4.0
    backward: float = 8.0
    tp_all_reduce: float = 0.4
    p2p: float = 0.3
    dp_all_reduce: float = 6.0
    optimizer: float = 3.0
    data: float = 1.0
    compute_noise: float = 0.03
    comm_noise: float = 0.04
    rank_spread: float = 0.01  # persistent per-rank speed differences of healthy hardware
    stage_work: tuple[float, ...] | None = None  # heterogeneous stages: relative work of each (written to headers)
    act_bytes: int = 8 << 20
    grad_bytes: int = 256 << 20


def one_f_one_b(pp: int, m: int) -> list[list[tuple[str, int]]]:
    """Per-stage task order of 1F1B: warm-up forwards, steady F/B pairs, cool-down backwards."""
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        order = [("F", j) for j in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append(("F", f))
                f += 1
            order.append(("B", b))
            b += 1
        orders.append(order)
    return orders


def task_order(pp: int, m: int) -> list[tuple[int, str, int]]:
    """A global order of (stage, kind, microbatch) that respects every stage's order and the P2P dependencies."""
    orders = one_f_one_b(pp, m)
    done: set[tuple[int, str, int]] = set()
    out: list[tuple[int, str, int]] = []
    ptr = [0] * pp
    while len(out) < 2 * m * pp:
        progressed = False
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                kind, j = orders[s][ptr[s]]
                dep = (s - 1, "F", j) if kind == "F" and s > 0 else (s + 1, "B", j) if kind == "B" and s < pp - 1 \
                    else None
                if dep is not None and dep not in done:
                    break
                done.add((s, kind, j))
                out.append((s, kind, j))
                ptr[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B order has a cycle")  # cannot happen for a valid schedule
    return out


class _Slots:
    """Every emitted span, kept per pipeline stage. The schedule is static, so every rank of a stage emits the same
    spans in the same order (its "slots"): a slot's metadata is kept once, its start times and durations as one
    (dp, tp) plane. At 100,096 ranks x 10 iterations (128 million spans) that is 2 GB of times and a few MB of
    metadata, where a row per span with eleven columns of its own took 11 GB."""

    META = ("name", "cat", "it", "group", "seq", "peer_stage", "nbytes", "mb")

    def __init__(self, pp: int, plane: tuple[int, int]) -> None:
        self.plane = plane
        self.ts: list[list[np.ndarray]] = [[] for _ in range(pp)]
        self.dur: list[list[np.ndarray]] = [[] for _ in range(pp)]
        self.meta: list[list[tuple]] = [[] for _ in range(pp)]

    def emit(self, s: int, name: str, cat: str, ts, dur, it: int, group: int = 0, seq: int = -1,
             peer_stage: int = -1, nbytes: int = 0, mb: int = -1) -> None:
        # Copies: the caller keeps updating its time arrays in place after emitting.
        self.ts[s].append(np.array(np.broadcast_to(ts, self.plane), np.float64))
        self.dur[s].append(np.array(np.broadcast_to(dur, self.plane), np.float64))
        self.meta[s].append((NAMES.index(name), CAT_INDEX[cat], it, group, seq, peer_stage, nbytes, mb))

    def count(self) -> int:
        return sum(len(x) for x in self.ts) * self.plane[0] * self.plane[1]

    def take(self, s: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Stage s's spans as (ranks of the stage, slots) arrays of start and duration, a rank's spans in one
        contiguous row, plus metadata; the stage's own lists are released. Where every rank's spans sort in the
        first rank's time order (the usual case) they come in that order, metadata per slot, and the last item is
        None; otherwise in emission order with `_time_order`'s per-row index (metadata then per rank)."""
        n = self.plane[0] * self.plane[1]
        ts_l, dur_l = self.ts[s], self.dur[s]
        o = np.argsort([p.flat[0] for p in ts_l], kind="stable")
        # The check _time_order makes, plane by plane (no stacked copy): ties in emission order, as a stable sort.
        ordered = all(((ts_l[b] >= ts_l[a]) if b > a else (ts_l[b] > ts_l[a])).all() for a, b in zip(o, o[1:]))
        meta = {k: np.array(v, np.int64) for k, v in zip(self.META, zip(*self.meta[s]))}
        self.ts[s], self.dur[s], self.meta[s] = [], [], []
        if ordered:  # stacked in time order at once: no gather of 2 x 66 MB afterwards
            ts = np.stack([ts_l[i] for i in o], axis=-1).reshape(n, -1)
            dur = np.stack([dur_l[i] for i in o], axis=-1).reshape(n, -1)
            return ts, dur, {k: v[o][None, :] for k, v in meta.items()}, None
        ts = np.stack(ts_l, axis=-1).reshape(n, -1)
        dur = np.stack(dur_l, axis=-1).reshape(n, -1)
        o, idx = _time_order(ts)
        rows = np.arange(len(ts))[:, None]
        return ts[rows, idx], dur[rows, idx], {k: v[idx] for k, v in meta.items()}, idx


NAMES = ["data", "forward", "backward", "all_reduce", "send", "recv", "optimizer", "step"]


@dataclass
class SimResult:
    """What `simulate` wrote: the grid, the faults (ground truth) and the clock offsets it used."""

    out_dir: str
    world: int
    tp: int
    pp: int
    dp: int
    iterations: int
    microbatches: int
    faults: list[Fault] = field(default_factory=list)
    offsets_ns: list[int] = field(default_factory=list)
    spans: int = 0
    drift_ppm: list[float] = field(default_factory=list)  # local clock = offset + (1 + ppm * 1e-6) * true time


def ring_shift(n: int, a: int, b: int, factor: float) -> np.ndarray:
    """Per ring position: how much earlier than the last member it leaves a ring collective whose link between
    positions a and b is `factor` times slower, in units of the collective's nominal cost.

    A ring all-reduce over n members is 2(n-1) steps of one chunk (cost c = C / (2(n-1))) from each member to its
    successor. The slow link carries its chunks at f*c each, so its receiver q gets chunk k at ~(k+1)*f*c and is
    last out at f*C; the member d places downstream of q gets every chunk d hops later at healthy speed, so it
    leaves d*(f-1)*c earlier, and the link's sender (d = n-1) leaves first. Only the direction the ring uses is
    slow in effect (a->b when b follows a, else b->a). A ring of two uses both directions of the cable: everyone
    leaves together, as does a ring that does not use the link at all (ranks not adjacent in group order; NCCL's
    trees or other rings might, which this model leaves to the group-wide slowdown)."""
    out = np.zeros(n)
    if n <= 2 or (b - a) % n not in (1, n - 1):
        return out
    q = b if (b - a) % n == 1 else a
    d = (np.arange(n) - q) % n
    return d * (factor - 1.0) / (2 * (n - 1))


def simulate_spans(world: int, tp: int, pp: int, dp: int, iterations: int, microbatches: int,
                   faults: list[Fault], seed: int, costs: Costs) -> _Slots:
    """Run the simulation; return every span, per stage, in true (global) time, ns."""
    rng = np.random.default_rng(seed)
    speed = np.exp(rng.normal(0.0, costs.rank_spread, (pp, dp, tp)))
    if costs.stage_work is not None:
        if len(costs.stage_work) != pp:
            raise ValueError(f"stage_work has {len(costs.stage_work)} entries for pp={pp} stages")
        speed = speed * np.asarray(costs.stage_work, float)[:, None, None]
    pause = np.zeros((pp, dp, tp))
    pause_every = np.ones((pp, dp, tp), np.int64)
    late = np.zeros((pp, dp, tp))
    p2p_fac = np.ones((pp, pp, dp, tp))  # [src stage, dst stage] per column
    tp_fac = np.ones((pp, dp))
    dp_fac = np.ones((pp, tp))
    # How much earlier than the group's last member each member leaves a ring collective (in units of the
    # collective's nominal cost): zero unless one ring link is slow (ring_shift).
    tp_shift = np.zeros((pp, dp, tp))
    dp_shift = np.zeros((pp, dp, tp))

    def where(r: int) -> tuple[int, int, int]:
        if not 0 <= r < world:
            raise ValueError(f"fault names rank {r}, outside a world of {world}")
        return r // (tp * dp), (r // tp) % dp, r % tp

    for f in faults:
        if f.kind == "slow-compute":
            speed[where(f.ranks[0])] *= f.factor
        elif f.kind == "pause":
            pause[where(f.ranks[0])] = f.ms * MS
            pause_every[where(f.ranks[0])] = max(1, f.every)
        elif f.kind == "late-arrival":
            late[where(f.ranks[0])] = f.ms * MS
        else:
            (sa, da, ta), (sb, db, tb) = where(f.ranks[0]), where(f.ranks[1])
            if (da, ta) == (db, tb) and abs(sa - sb) == 1:
                p2p_fac[sa, sb, da, ta] *= f.factor
                p2p_fac[sb, sa, da, ta] *= f.factor
            elif (sa, da) == (sb, db):
                tp_fac[sa, da] *= f.factor  # the ring's last member out leaves at the pace of its slowest link
                tp_shift[sa, da, :] += ring_shift(tp, ta, tb, f.factor)
            elif (sa, ta) == (sb, tb):
                dp_fac[sa, ta] *= f.factor
                dp_shift[sa, :, ta] += ring_shift(dp, da, db, f.factor)
            else:
                raise ValueError(f"slow-link {f.ranks[0]}-{f.ranks[1]}: the two ranks share no TP, DP or "
                                 "adjacent-stage PP link; pick neighbours in one parallel group")

    def noise(sigma: float, shape) -> np.ndarray:
        return np.exp(rng.normal(0.0, sigma, shape))

    out = _Slots(pp, (dp, tp))
    T = np.zeros((pp, dp, tp))
    tp_seq = [0] * pp
    dp_seq = [0] * pp
    p2p_seq: dict[tuple[int, int], int] = {}
    order = task_order(pp, microbatches)
    base = {"F": costs.forward * MS, "B": costs.backward * MS}
    for it in range(iterations):
        T += late  # untraced host-side stall before the iteration (slow dataloader worker, contention)
        start = T.copy()
        d = costs.data * MS * noise(costs.compute_noise, T.shape)
        for s in range(pp):
            out.emit(s, "data", "data", T[s], d[s], it)
        T += d
        paused = np.where((it + 1) % pause_every == 0, pause, 0.0)
        sent: dict[tuple[int, str, int], np.ndarray] = {}
        for s, kind, j in order:
            src = s - 1 if kind == "F" else s + 1
            if 0 <= src < pp:  # receive the activation (F) or the gradient (B)
                key = (src, s)
                k = p2p_seq.get(key, 0)
                p2p_seq[key] = k + 1
                post, ready = T[s], sent.pop((src, kind, j))
                done = np.maximum(post, ready) + costs.p2p * MS * p2p_fac[src, s] * noise(costs.comm_noise,
                                                                                         (dp, tp))
                nb = costs.act_bytes
                out.emit(s, "recv", "comm", post, done - post, it, 2, k, src, nb, j)
                out.emit(src, "send", "comm", ready, done - ready, it, 2, k, s, nb, j)
                T[s] = done
            t0 = T[s].copy()
            c = base[kind] * speed[s] * noise(costs.compute_noise, (dp, tp))
            if kind == "F" and j == 0:
                c = c + paused[s]  # a GC / preemption pause lands inside the first forward
            arrive = T[s] + c
            if tp > 1:
                nz = noise(costs.comm_noise, dp)
                end = arrive.max(axis=1) + costs.tp_all_reduce * MS * tp_fac[s] * nz
                early = costs.tp_all_reduce * MS * nz[:, None] * tp_shift[s]
                leave = end[:, None] - early + rng.uniform(0, 0.02 * MS, (dp, tp))
                out.emit(s, "all_reduce", "comm", arrive, leave - arrive, it, 1, tp_seq[s], -1, 4 << 20, j)
                tp_seq[s] += 1
                arrive = leave
            T[s] = arrive
            out.emit(s, "forward" if kind == "F" else "backward", "compute", t0, T[s] - t0, it, mb=j)
            dst = s + 1 if kind == "F" else s - 1
            if 0 <= dst < pp:
                sent[(s, kind, j)] = T[s].copy()  # isend: the stage goes on, the receiver picks it up
        if dp > 1:
            nz = noise(costs.comm_noise, (pp, tp))
            end = T.max(axis=1) + costs.dp_all_reduce * MS * dp_fac * nz
            early = costs.dp_all_reduce * MS * nz[:, None, :] * dp_shift
            leave = end[:, None, :] - early + rng.uniform(0, 0.05 * MS, T.shape)
            for s in range(pp):
                out.emit(s, "all_reduce", "comm", T[s], leave[s] - T[s], it, 3, dp_seq[s], -1,
                         costs.grad_bytes)
                dp_seq[s] += 1
            T = leave
        o = costs.optimizer * MS * speed * noise(costs.compute_noise, T.shape)
        for s in range(pp):
            out.emit(s, "optimizer", "optimizer", T[s], o[s], it)
        T = T + o
        for s in range(pp):
            out.emit(s, "step", "step", start[s], T[s] - start[s], it)
    return out


def simulate(out_dir: str | Path, ranks: int, tp: int, pp: int, dp: int | None = None, iterations: int = 5,
             faults: list[Fault] | list[str] = (), seed: int = 0, microbatches: int | None = None,
             costs: Costs | None = None, clock_ppm: float = 20.0) -> SimResult:
    """Write `rank*.mst` files of a simulated job plus `ground_truth.json`; return what was simulated."""
    if tp < 1 or pp < 1 or ranks < 1:
        raise ValueError(f"ranks, tp and pp must be >= 1 (got ranks={ranks}, tp={tp}, pp={pp})")
    if dp is None:
        if ranks % (tp * pp):
            raise ValueError(f"--ranks {ranks} is not a multiple of tp*pp = {tp * pp}")
        dp = ranks // (tp * pp)
    if tp * pp * dp != ranks:
        raise ValueError(f"--ranks {ranks} != tp*pp*dp = {tp}*{pp}*{dp}")
    m = microbatches if microbatches is not None else max(pp, 2)
    flist = [parse_fault(f) if isinstance(f, str) else f for f in faults]
    costs = costs or Costs()
    spans = simulate_spans(ranks, tp, pp, dp, iterations, m, flist, seed, costs)
    rng = np.random.default_rng(seed + 1)
    # Clocks as they are: hosts of 8 ranks share a CLOCK_MONOTONIC, booted days apart, each running fast or slow
    # by tens of ppm. Ranks of one host read the SAME clock (their headers say so: same host), so they get no
    # per-process offset of their own; the draw is kept so every other random number stays as it was.
    hosts = (ranks + 7) // 8
    host_base = rng.uniform(0.0, 5 * 86_400_000.0, hosts) * MS
    host_drift = rng.normal(0.0, clock_ppm * 1e-6, hosts)
    rng.uniform(-0.05, 0.05, ranks)
    offsets = host_base[np.arange(ranks) // 8].astype(np.int64)
    drift = host_drift[np.arange(ranks) // 8]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Files of ranks this job writes are overwritten in place (their inodes reused): on ext4 without a journal a new
    # inode skips every inode deleted in the last minutes, and re-simulating 100,096 ranks after deleting them cost
    # ~28% of the CPU in that search. Only the files this job does not write are removed.
    # A file that is a symlink or has other hard links is removed, not written through (a `cp -al` copy of the
    # earlier job must not change).
    keep = {rank_file(out, r).name for r in range(ranks)}
    for old in out.glob("rank*.mst"):
        st = old.lstat()
        if old.name not in keep or stat.S_ISLNK(st.st_mode) or st.st_nlink > 1:
            old.unlink()
    n_spans = spans.count()
    # A stage at a time, written by two threads while the next stage's records are made (the kernel's file writes
    # and checksums run without the GIL); at most two stages' times (128 MB each at 100,096 ranks) are held.
    with ThreadPoolExecutor(WRITERS) as pool:
        pending: list[Future] = []
        for s in range(pp):
            stage = np.arange(s * dp * tp, (s + 1) * dp * tp)  # rank = tp + tp*(dp + dp*pp)
            ahead = _write_stage(out, spans, s, stage, (tp, pp, dp), offsets, drift, costs.stage_work, pool)
            for f in pending:
                f.result()
            pending = ahead
        for f in pending:
            f.result()
    res = SimResult(str(out), ranks, tp, pp, dp, iterations, m, flist, offsets.tolist(), n_spans,
                    (drift * 1e6).tolist())
    truth = {**asdict(res), "faults": [{**asdict(f), "label": f.label()} for f in flist]}
    write_exclusive(out / "ground_truth.json", json.dumps(truth).encode())  # a link there is replaced, not followed
    return res


def _time_order(ts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The stable order of each row's slots by time (ranks x slots): (one order for all rows, None), or (per-row
    orders, their index array) where rows differ.

    Every rank of a stage usually has its slots in the same time order, so the first row's order is tried on all
    and only the rows it does not sort get a sort of their own. Ties keep emission order (a stable sort), as one
    lexsort of (rank, ts) over every span did."""
    o = np.argsort(ts[0], kind="stable")
    step = np.diff(ts[:, o], axis=1)
    # Sorted, with ties in emission order: strictly later where the slot order steps back.
    ok = np.where((np.diff(o) > 0)[None, :], step >= 0, step > 0).all(axis=1)
    del step
    if ok.all():
        return o, None
    idx = np.broadcast_to(o, ts.shape).copy()
    bad = np.flatnonzero(~ok)
    idx[bad] = np.argsort(ts[bad], axis=1, kind="stable")
    return o, idx


def _write_stage(out: Path, spans: _Slots, s: int, ranks: np.ndarray, topo: tuple[int, int, int],
                 offsets: np.ndarray, drift: np.ndarray, stage_work: tuple[float, ...] | None,
                 pool: ThreadPoolExecutor) -> list[Future]:
    """Hand the rank files of stage s to the writer threads: its spans in time order per rank, on each rank's
    local clock. Returns the writes' futures (the records live until they are done)."""
    tp, pp, dp = topo
    ts, dur, meta, _ = spans.take(s)  # in time order per rank; metadata per slot (1, slots) or per rank
    # Round ends, not durations: a nested span must not poke 1 ns past its parent.
    start = np.floor(ts).astype(np.int64)
    d = np.maximum(np.floor(ts + dur).astype(np.int64) - start, 0)
    del ts, dur
    # Local clock = offset + (1 + drift) * true time; durations are read on the same drifting clock.
    dr = drift[ranks][:, None]
    start += offsets[ranks][:, None] + np.round(dr * start).astype(np.int64)
    d += np.round(dr * d).astype(np.int64)
    g, cat = meta["group"], meta["cat"]
    ps = meta["peer_stage"]
    # Per-slot columns (or per rank and slot where ranks' orders differ); names and groups are registered in the same
    # order in every file, so the ids need no remapping.
    fixed = (("name", meta["name"]), ("cat", cat), ("it", meta["it"]), ("gid", np.where(g > 0, g - 1, -1)),
             ("seq", meta["seq"]), ("nbytes", meta["nbytes"]), ("chunk", np.where(cat == 0, 0, -1)),
             ("mb", meta["mb"]))
    world = len(offsets)

    def write(lo: int, hi: int) -> None:
        # Blocks are packed here, a few hundred ranks at a time (format.pack_columns): one layout for the batch.
        cols = {"ts": start[lo:hi], "dur": d[lo:hi]}  # cpu_wait left out: -1, simulated ranks own their device
        for k, v in fixed:
            cols[k] = v if len(v) == 1 else v[lo:hi]
        # A P2P peer is the same (dp, tp) position of the peer stage: tp * dp ranks away per stage.
        p = ps if len(ps) == 1 else ps[lo:hi]
        cols["peer"] = np.where(p >= 0, ranks[lo:hi, None] + (p - s) * tp * dp, -1)
        blocks = pack_columns(cols)
        no_wait = np.full(cols["ts"].shape[1], -1, np.int64)
        heads, groups, rows = [], [], []
        for i in range(lo, hi):
            r = int(ranks[i])
            d_, t = (r // tp) % dp, r % tp
            first = tp * (d_ + dp * s)  # (tp 0, this replica, this stage)
            groups.append([("tp", range(first, first + tp)), ("pp", range(r % (tp * dp), world, tp * dp)),
                           ("dp", range(t + tp * dp * s, t + tp * dp * (s + 1), tp))])
            head = {"rank": r, "world": world, "coord": [d_, s, t], "topo": [tp, pp, dp], "host": f"node{r // 8}",
                    "pid": 10_000 + r, "clock": "monotonic_ns", "simulated": True}
            if stage_work is not None:
                head["stage_work"] = list(stage_work)  # what a cost model of the job would say
            heads.append(head)
            k = i - lo
            rows.append(RankTrace(r, world, (d_, s, t), (tp, pp, dp), head, NAMES, groups[-1], cpu_wait=no_wait,
                                  **{c: v[0] if len(v) == 1 else v[k] for c, v in cols.items()}))
        # Each rank's summary block (rank_summary.py), from the very columns its file holds, as a tracer leaves one.
        # One slot order for the stage (_time_order sorted every row by it): the batch is what features._uniform
        # checks for, by construction.
        same = all(len(cols[k]) == 1 for k in ("name", "cat", "it", "gid"))
        sums = summary_blocks(rows, (cols["ts"], cols["dur"], cols["peer"]) if same else None)
        for i in range(lo, hi):
            k = i - lo
            write_rank_file(rank_file(out, heads[k]["rank"]), heads[k], NAMES, groups[k], blocks[k], sums[k])

    step = 256
    return [pool.submit(write, lo, min(lo + step, len(ranks))) for lo in range(0, len(ranks), step)]
