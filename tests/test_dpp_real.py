"""MegaDPP on real gloo processes: every dynamic policy trains exactly like one process and like 1F1B, while random
delays on every pipeline send (and an injected slow rank) shuffle the order in which inputs arrive.

Uses the engine's equivalence machinery (tests/engine_cases.py); cases of one world size share one launch.
"""
from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import pytest
import torch

from megatronapp.launch import spawn
from megatronapp.parallel import comm
from tests import engine_cases as ec


def _dpp(policy: str, seed: int, inject: list[str] | None = None, **over) -> dict:
    case = ec.base_case("gpt2", **{"parallel.schedule": "dpp", "parallel.dpp_policy": policy, **over})
    case["inject"] = list(inject or [])
    case["delay_seed"] = seed
    return case


def _cases_world2() -> list[tuple[str, dict]]:
    return [
        ("pp2 1f1b (no delays)", ec.base_case("gpt2", **{"parallel.pp": 2})),
        ("pp2 dpp dfs", _dpp("dfs", 1, **{"parallel.pp": 2})),
        ("pp2 dpp bfs", _dpp("bfs", 2, **{"parallel.pp": 2})),
        ("pp2 dpp adaptive, slow rank 1", _dpp("adaptive", 3, ["slow-compute=1:2"], **{"parallel.pp": 2})),
        ("pp2 vpp2 dpp adaptive, cap 2 (minimum), 3 microbatches",
         _dpp("adaptive", 4, **{"parallel.pp": 2, "parallel.vpp": 2, "parallel.dpp_max_inflight": 2,
                                "parallel.microbatches": 3, "train.global_batch_size": 6})),
        ("pp2 vpp2 dpp bfs, cap 3", _dpp("bfs", 5, **{"parallel.pp": 2, "parallel.vpp": 2,
                                                      "parallel.dpp_max_inflight": 3})),
    ]


def _cases_world4() -> list[tuple[str, dict]]:
    return [
        ("tp2 pp2 1f1b (no delays)", ec.base_case("gpt2", **{"parallel.tp": 2, "parallel.pp": 2})),
        ("tp2 pp2 dpp adaptive (tp-rank 0 decides)", _dpp("adaptive", 6, **{"parallel.tp": 2, "parallel.pp": 2})),
        ("pp4 vpp2 dpp dfs, cap 2, 6 microbatches",
         _dpp("dfs", 7, **{"parallel.pp": 4, "parallel.vpp": 2, "parallel.dpp_max_inflight": 2,
                           "parallel.microbatches": 6, "train.global_batch_size": 6})),
    ]


def delayed_worker(rank: int, world: int, cases: list[dict], outdir: str) -> None:
    """Spawned entry: run each case with a seeded random 0-4 ms delay before every pipeline send."""
    original_reset = comm.reset
    for i, case in enumerate(cases):
        seed = case.pop("delay_seed", None)
        if seed is not None:
            rng = random.Random(seed * 1000 + rank)

            def jitter(op: comm.CommOp, rng: random.Random = rng) -> None:
                if op.name == "send" and op.group.startswith("pp."):  # the pipeline's channels
                    time.sleep(rng.uniform(0.0, 0.004))

            def reset_then_delay(jitter=jitter) -> None:
                original_reset()
                comm.add_interceptor(jitter)

            comm.reset = reset_then_delay  # run_case resets comm first; the delays go in right after
        try:
            torch.save(ec.run_case(case, rank), Path(outdir) / f"case{i}_rank{rank}.pt")
        finally:
            comm.reset = original_reset


def _run(world: int, cases: list[tuple[str, dict]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(delayed_worker, world, [c for _, c in cases], tmp)
        loaded = [[torch.load(Path(tmp) / f"case{i}_rank{r}.pt", weights_only=False) for r in range(world)]
                  for i in range(len(cases))]
    baseline = ec.stitch(loaded[0], "grads")  # the case list starts with 1F1B on the same layout
    for (label, case), results in zip(cases, loaded):
        case = {k: v for k, v in case.items() if k != "delay_seed"}
        ec.compare(results, ec.reference(case), label)
        if case["parallel"].get("microbatches", 4) == 4 and case["train"]["global_batch_size"] == 8:
            grads = ec.stitch(results, "grads")
            for name, g in grads.items():
                torch.testing.assert_close(g, baseline[name], atol=2e-5, rtol=1e-4,
                                           msg=lambda m, n=name, lb=label: f"{lb} vs 1F1B, grad {n}: {m}")


@pytest.mark.slow
def test_dynamic_policies_match_single_process_and_1f1b_two_ranks():
    _run(2, _cases_world2())


@pytest.mark.slow
def test_dynamic_policies_match_single_process_and_1f1b_four_ranks():
    _run(4, _cases_world4())
