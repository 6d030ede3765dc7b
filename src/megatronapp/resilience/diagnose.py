"""`megatronapp diagnose`: find the bad machine before (re)starting a job, with real tests on real ranks.

Per rank: GEMM throughput and a memory write/verify pass with its bandwidth. Per pair of ranks: P2P latency (a
4-byte ping-pong) and bandwidth (4 MiB one way, acknowledged). Per process group (tp, pp, dp, world): all-reduce
time of 1 MiB. Outliers are judged against the median of their peers with the robust statistics MegaScan uses
(`scan.detect.stats.robust_excess`: leave-one-out median for small groups, 1.4826 MAD floored at a fraction of the
reference): a value is an outlier when it is worse than its reference by both a relative margin and a robust z.
A rank in most of the outlying pairs is named as the likely bad end. On one machine the tests are real but the
bad machine is one you inject (`--inject slow-compute=RANK:FACTOR`, `slow-link=A-B:MS`), through the same fault
drills as training.
"""
from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatronapp import tracing
from megatronapp.parallel import comm
from megatronapp.parallel import topology as topology_mod

REPS = 5


def _best_time(fn, reps: int = REPS) -> float:
    """The fastest of `reps` runs: on a shared machine the least disturbed run is the one that measures the
    hardware (an injected or real slowdown slows every run, so it survives the minimum)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _gemm(n: int = 256) -> float:
    """TFLOP/s of an n x n fp32 matmul (the best of REPS timed batches)."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def batch() -> None:
        with tracing.span("gemm", "compute"):  # a compute span: the slow-compute drill acts on it
            for _ in range(8):
                torch.mm(a, b)

    return 8 * 2 * n**3 / _best_time(batch) / 1e12


def _memory(mib: int = 64) -> dict[str, Any]:
    """Write a pattern, read it back: bandwidth and whether every byte came back."""
    n = mib * (1 << 20) // 4
    buf = torch.empty(n, dtype=torch.int32)
    pattern = torch.arange(n, dtype=torch.int32)
    t = _best_time(lambda: buf.copy_(pattern), 3)
    return {"mib": mib, "gib_s": mib / 1024 / t, "ok": bool(torch.equal(buf, pattern))}


def _pairs_rounds(world: int) -> list[list[tuple[int, int]]]:
    """Every pair once, in rounds of disjoint pairs (the circle method), so pairs of a round run at once."""
    ranks = list(range(world)) + ([None] if world % 2 else [])
    n = len(ranks)
    rounds = []
    for _ in range(n - 1):
        rounds.append([tuple(sorted((ranks[i], ranks[n - 1 - i]))) for i in range(n // 2)
                       if ranks[i] is not None and ranks[n - 1 - i] is not None])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


GROUP_KINDS = ("tp", "pp", "dp", "world")


def group_members(topo: topology_mod.Topology, kind: str, rank: int) -> tuple[int, ...]:
    """Global ranks, in group order, of the `kind` group that holds `rank`."""
    return tuple(range(topo.world_size)) if kind == "world" else getattr(topo, f"{kind}_ranks")(rank)


def ring_pairs(topo: topology_mod.Topology, kind: str, rank: int) -> list[tuple[int, int]]:
    """The ring-neighbour links (a -> b, group order, wrapping) of the `kind` group that holds `rank`: the links a
    ring collective over that group uses (NCCL's default ring follows rank order within a node; the
    pair a MegaScan finding names is a pair of neighbours in group order)."""
    members = group_members(topo, kind, rank)
    n = len(members)
    return [] if n < 2 else [(members[i], members[(i + 1) % n]) for i in range(n if n > 2 else 1)]


def _ring_rounds(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Ring links in rounds of disjoint pairs (even links, odd links, and the closing one of an odd ring)."""
    rounds: list[list[tuple[int, int]]] = []
    for link in pairs:
        for rd in rounds:
            if not {*link} & {r for p in rd for r in p}:
                rd.append(link)
                break
        else:
            rounds.append([link])
    return rounds


def _p2p(me: int, peer: int, world_group: topology_mod.Group) -> dict[str, float] | None:
    """Ping-pong with `peer`; the lower rank times it and returns latency (s) and bandwidth (GiB/s)."""
    small, big = torch.zeros(1), torch.zeros(1 << 20)  # 4 B and 4 MiB

    def exchange(t: torch.Tensor) -> None:
        if me < peer:
            comm.send(t, peer, world_group)
            comm.recv(small, peer, world_group)
        else:
            comm.recv(t, peer, world_group)
            comm.send(small, peer, world_group)

    exchange(small)  # warm-up: connects the pair
    lat = _best_time(lambda: exchange(small)) / 2
    bw_t = _best_time(lambda: exchange(big))
    return {"latency_s": lat, "gib_s": big.numel() * 4 / (1 << 30) / max(bw_t - lat, 1e-9)} if me < peer else None


def diagnose_rank(rank: int, world: int, shape: tuple[int, int, int], inject: list[str], out: str,
                  group: tuple[str, int] | None = None) -> None:
    """Entry of one rank (launch.spawn): every test, results to `<out>/rank<r>.json`.

    With `group` (kind, rank) the pairs tested are the ring-neighbour links of that one group, not every pair of
    the world (which at scale is out of reach): the probe that confirms a slow link MegaScan found inside it."""
    from megatronapp import faults  # the drills are a plug-in module; diagnose uses them as the trainer does

    comm.reset()
    tp, pp, dp = shape
    topo = topology_mod.build(tp, pp, dp, rank)
    injector = faults.install(inject, topo) if inject else None
    try:
        res: dict[str, Any] = {"rank": rank, "label": topo.coord.label(), "gemm_tflops": _gemm(),
                               "memory": _memory(), "pairs": {}, "groups": {}}
        world_group = topo.groups["world"]
        rings = ring_pairs(topo, *group) if group else []
        if group:
            res["ring"] = {"group": f"{group[0]}{list(group_members(topo, *group))}",
                           "links": [f"{a}-{b}" for a, b in rings]}
        for pairs in _ring_rounds(rings) if group else _pairs_rounds(world):
            for a, b in pairs:
                if rank in (a, b):
                    # The lower rank times the pair; the ring link keeps its direction in the name.
                    got = _p2p(rank, b if rank == a else a, world_group)
                    if got:
                        res["pairs"][f"{a}-{b}"] = got
            comm.barrier(world_group)
        for name in ("tp", "pp", "dp", "world"):
            g = topo.groups[name]
            if g.size > 1:
                t = torch.ones(1 << 18)
                comm.all_reduce(t, g)  # warm-up
                res["groups"][f"{name}{list(g.ranks)}"] = _best_time(lambda t=t, g=g: comm.all_reduce(t, g))
    finally:
        if injector is not None:
            injector.remove()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def _outliers(values: dict[Any, float], higher_is_better: bool, rel: float = 0.3, zmin: float = 3.0
              ) -> list[dict[str, Any]]:
    """Members worse than their peers' (leave-one-out) median by > rel and > zmin robust sigmas."""
    from megatronapp.scan.detect.stats import robust_excess

    keys = list(values)
    if len(keys) < 2:
        return []
    x = np.array([[values[k]] for k in keys], dtype=float)
    ref, exc, z = robust_excess(x, np.zeros(len(keys), dtype=int), floor=0.1)
    sign = -1.0 if higher_is_better else 1.0
    found = []
    for i, k in enumerate(keys):
        worse, r = sign * exc[i, 0], ref[i, 0]
        if r > 0 and worse > rel * r and sign * z[i, 0] > zmin:
            found.append({"who": k, "value": values[k], "reference": float(r), "factor": float(values[k] / r)})
    return found


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Outliers per test, and the rank most often at the bad end of a pair."""
    gemm = _outliers({r["rank"]: r["gemm_tflops"] for r in results}, higher_is_better=True)
    memory = _outliers({r["rank"]: r["memory"]["gib_s"] for r in results}, higher_is_better=True)
    bad_memory = [r["rank"] for r in results if not r["memory"]["ok"]]
    pairs = {k: v for r in results for k, v in r["pairs"].items()}
    slow_bw = _outliers({k: v["gib_s"] for k, v in pairs.items()}, higher_is_better=True)
    slow_lat = _outliers({k: v["latency_s"] for k, v in pairs.items()}, higher_is_better=False)
    groups: dict[str, float] = {}
    for r in results:
        groups.update(r["groups"])
    kinds: dict[str, dict[str, float]] = {}
    for g, t in groups.items():
        kinds.setdefault(g.split("[")[0], {})[g] = t
    slow_groups = [o for same in kinds.values() for o in _outliers(same, higher_is_better=False)]
    ends = Counter(int(e) for o in slow_bw + slow_lat for e in o["who"].split("-"))
    link_suspect = [r for r, c in ends.items() if c == max(ends.values())] if ends else []
    ring = next((r["ring"] for r in results if r.get("ring")), None)
    return {"ranks": {r["rank"]: r["label"] for r in results}, "ring": ring, "gemm": gemm, "memory": memory,
            "memory_errors": bad_memory, "p2p_bandwidth": slow_bw, "p2p_latency": slow_lat,
            "allreduce": slow_groups, "link_suspects": sorted(link_suspect) if len(ends) > 1 else [],
            "raw": results}


def report(a: dict[str, Any]) -> str:
    label = a["ranks"]
    lines = []
    for o in a["gemm"]:
        lines.append(f"rank {o['who']} ({label[o['who']]}): GEMM {o['value'] * 1e3:.2f} GFLOP/s, {o['factor']:.2f}x "
                     f"the median of its peers ({o['reference'] * 1e3:.2f})")
    for o in a["memory"]:
        lines.append(f"rank {o['who']} ({label[o['who']]}): memory copy {o['value']:.2f} GiB/s, {o['factor']:.2f}x "
                     f"its peers")
    for r in a["memory_errors"]:
        lines.append(f"rank {r} ({label[r]}): memory check FAILED (a pattern did not read back)")
    for o in a["p2p_bandwidth"]:
        lines.append(f"link {o['who']}: P2P bandwidth {o['value']:.2f} GiB/s, {o['factor']:.2f}x the median pair")
    for o in a["p2p_latency"]:
        lines.append(f"link {o['who']}: P2P latency {o['value'] * 1e6:.0f} us, {o['factor']:.1f}x the median pair")
    for o in a["allreduce"]:
        lines.append(f"group {o['who']}: all-reduce {o['value'] * 1e3:.2f} ms, {o['factor']:.1f}x similar groups")
    if a.get("ring"):
        slow = {o["who"] for o in a["p2p_bandwidth"] + a["p2p_latency"]}
        lines.append(f"ring links of {a['ring']['group']} probed: {', '.join(a['ring']['links'])}; "
                     + (f"slow: {', '.join(sorted(slow))}" if slow else "none stands out"))
    if a["link_suspects"]:
        lines.append(f"rank(s) at the end of most slow links: {', '.join(map(str, a['link_suspects']))}")
    return "\n".join(lines) if lines else "no outliers: every rank, pair and group within the noise of its peers"


class DiagnoseTimeout(RuntimeError):
    """The tests did not finish within their time budget (itself a sign of a hung rank or link)."""


def run_within(nproc: int, shape: tuple[int, int, int], inject: list[str], budget_s: float,
               threads: int = 1) -> dict[str, Any]:
    """`run` with a wall-clock budget (the supervisor's check before a restart): ranks still running when it
    is spent are stopped and DiagnoseTimeout names the ranks that had not finished; a failed rank raises."""
    from megatronapp import launch

    with tempfile.TemporaryDirectory(prefix="diagnose-") as out:
        job = launch.start(diagnose_rank, nproc, shape, inject, out, None, threads=threads)
        try:
            deadline = time.monotonic() + budget_s
            while job.running() and not job.exits() and time.monotonic() < deadline:
                job.wait(0.2)
            if job.exits():
                raise launch.first_failure(job.exits()).error()
            if job.running():
                late = [r for r in range(nproc) if not Path(out, f"rank{r}.json").is_file()]
                raise DiagnoseTimeout(f"diagnostics did not finish within {budget_s:.0f} s; ranks without "
                                      f"results: {', '.join(map(str, late))}")
        finally:
            job.close()
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
    return analyse(results)


def run(nproc: int, shape: tuple[int, int, int], inject: list[str], group: tuple[str, int] | None = None
        ) -> dict[str, Any]:
    """Spawn the ranks, run every test, analyse (`group`: probe only that group's ring links)."""
    from megatronapp.launch import spawn

    with tempfile.TemporaryDirectory(prefix="diagnose-") as out:
        spawn(diagnose_rank, nproc, shape, inject, out, group)
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
    return analyse(results)
