"""How fast a newcomer is had when no spare is ready: forked on demand from the fork server vs a spawned spare.

Both are the in-place job's own code (`resilience/spare_pool.py`) on the supervisor's store, for the job of
tests/test_resilience_inplace.py (tp2 x pp2 x dp2, a tiny model): a spawned spare is timed from its
`Process.start` to its `ctl/spare/<id>/ready` key (it imports torch and the trainer itself); an on-demand one
from the moment a failure asks the pool for a newcomer and finds none (`SparePool.take` on an empty pool) to the
same key, the fork server warmed beforehand, as it is a few seconds into a job. The two alternate, one at a
time, so a neighbour's load falls on both alike. Each spare is killed once ready. CPU-bound host: the figures
are the host's, with its load average.

Run: python -m benchmarks.bench_spare_start [--reps 5]   (writes benchmarks/results/spare_start.json)
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from megatronapp.cli import build_parser, config_from_args
from megatronapp.resilience import generations
from megatronapp.resilience.spare_pool import ForkServer, SparePool

RESULTS = harness.results_path("spare_start")
FLAGS = ["--nproc", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "12", "--layers", "2", "--hidden", "32",
         "--heads", "4", "--global-batch", "4", "--microbatches", "2", "--seq-len", "16", "--no-progress"]


def _ready(pool: SparePool, sid: int, timeout_s: float = 600.0) -> float:
    deadline = time.monotonic() + timeout_s
    while pool.spares[sid].ready_at is None:
        if time.monotonic() > deadline or pool.spares[sid].process.exitcode is not None:
            raise RuntimeError(f"spare {sid} not ready (exit {pool.spares[sid].process.exitcode})")
        time.sleep(0.01)
        pool.tend()
    return pool.spares[sid].ready_at


def _end(pool: SparePool) -> None:
    for p in pool.close():
        p.kill()
        p.join()


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "one rep per side; writes nothing")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 1
    clock = harness.Clock()
    store, listener = generations._store()  # noqa: SLF001 - the supervisor's own store
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, "--out", str(Path(tmp, "run"))]))
        job_args = (8, cfg.to_dict(), store.port, str(Path(tmp, "result.json")), tmp, 1, {})
        server = ForkServer("gloo")
        t0 = time.time()
        while not server.settled():
            time.sleep(0.01)
        if not server.usable():
            raise SystemExit(f"no fork server: {server.state()}")
        warm_s = server.ready_at - t0
        none = ForkServer("gloo", force_off="spawned side")
        spawned: list[float] = []
        forked: list[float] = []
        sids = 0  # one store for all: every spare gets a ready key of its own
        for rep in range(args.reps):
            for side in harness.rotation(["spawn", "fork"], rep):
                if side == "spawn":
                    pool = SparePool(0, store, job_args, none, lambda _m: None, lambda _e: None)
                    pool.next_sid = sids
                    s = pool.start("pool")
                    spawned.append(_ready(pool, s.sid) - s.started_at)
                    _end(pool)
                else:
                    pool = SparePool(0, store, job_args, server, lambda _m: None, lambda _e: None)
                    pool.next_sid = sids
                    asked = time.time()
                    (s,) = pool.take(1, 600.0, time.sleep)
                    assert s.path == "fork server" and s.method == "forkserver", s
                    forked.append(s.ready_at - asked)
                    s.process.kill()
                    s.process.join()
                sids = pool.next_sid
                print(f"rep {rep} {side}: {(spawned if side == 'spawn' else forked)[-1]:.2f} s", flush=True)
    listener.detach()  # the store owns the descriptor (generations._close says why)
    result = {"spawned_ready_s": spawned, "forked_on_demand_ready_s": forked,
              "median_spawned_s": statistics.median(spawned), "median_forked_s": statistics.median(forked),
              "fork_server_warm_s": warm_s, "machine": harness.machine(clock, cpu_bound_host=True)}
    if not args.quick:
        harness.write_result(result, RESULTS)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    print("load average at start / end:", result["machine"]["load_avg_at_start"], result["machine"]["load_avg_at_end"])


if __name__ == "__main__":
    main()
