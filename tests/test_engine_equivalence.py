"""Every parallel layout and schedule trains exactly like one process: losses, gradients, updated weights.

Cases of one world size share one launch of real gloo processes (launching is the expensive part). The suite
runs with gloo's own rules, then, in a second launch per world size, under the two NCCL communicator regimes
gloo can enforce: `nccl-eager` (every case: one stream per group, tags ignored, identical collective order) and
`nccl-lazy` (every case with a pipeline: blocking creation of each pair's communicator on first use). A layout
that would hang on GPUs fails here. The plain `nccl` mode is not run: both regimes include its rules, and
without point-to-point ops (pp = 1) lazy creation adds nothing to them (a collective's first use already
meets every member in the order check), so those cases run under nccl-eager only.
"""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch

from megatronapp.launch import spawn
from tests import engine_cases as ec

SCHEDULES_PP = ("gpipe", "1f1b", "interleaved-1f1b")


def _cases_world2() -> list[tuple[str, dict]]:
    cases = []
    for fam in ("gpt2", "llama"):
        cases.append((f"{fam} tp2", ec.base_case(fam, **{"parallel.tp": 2})))
        cases.append((f"{fam} dp2", ec.base_case(fam, **{"parallel.dp": 2})))
        for sch in SCHEDULES_PP:
            cases.append((f"{fam} pp2 {sch}", ec.base_case(fam, **{"parallel.pp": 2, "parallel.schedule": sch})))
    cases.append(("gpt2 tp2 sequence-parallel", ec.base_case("gpt2", **{"parallel.tp": 2,
                                                                        "parallel.sequence_parallel": True})))
    # TP overlap: chunked all-gathers/reduce-scatters overlapped with the GEMMs (and the fused SwiGLU GEMM).
    cases.append(("llama tp2 sequence-parallel tp-comm-overlap", ec.base_case("llama", **{
        "parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True})))
    cases.append(("llama pp2 uneven layers, 3 microbatches",
                  ec.base_case("llama", **{"parallel.pp": 2, "parallel.microbatches": 2, "model.num_layers": 5,
                                           "train.global_batch_size": 6})))
    cases.append(("gpt2 tp2 with global-norm clipping", ec.base_case("gpt2", **{"parallel.tp": 2,
                                                                               "train.grad_clip": 0.5})))
    cases.append(("gpt2 pp2 vpp2 interleaved", ec.base_case("gpt2", **{"parallel.pp": 2, "parallel.vpp": 2,
                                                                       "parallel.schedule": "interleaved-1f1b"})))
    # Split backward (B now, W later): static ZB-H1 and the dynamic zero-bubble policy.
    cases.append(("gpt2 pp2 zb-h1", ec.base_case("gpt2", **{"parallel.pp": 2, "parallel.schedule": "zb-h1"})))
    cases.append(("llama pp2 vpp2 dpp zb", ec.base_case("llama", **{
        "parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "dpp", "parallel.dpp_policy": "zb"})))
    # ZeRO-1: gradients reduce-scattered, optimizer state sharded over DP, parameters all-gathered.
    cases.append(("gpt2 dp2 zero1", ec.base_case("gpt2", **{"parallel.dp": 2, "parallel.zero": 1})))
    return cases


def _cases_world4() -> list[tuple[str, dict]]:
    cases = []
    for fam in ("gpt2", "llama"):
        for sch in SCHEDULES_PP:
            cases.append((f"{fam} tp2 pp2 {sch}", ec.base_case(fam, **{"parallel.tp": 2, "parallel.pp": 2,
                                                                        "parallel.schedule": sch})))
            cases.append((f"{fam} pp2 dp2 {sch}", ec.base_case(fam, **{"parallel.pp": 2, "parallel.dp": 2,
                                                                        "parallel.schedule": sch})))
        cases.append((f"{fam} pp2 dp2 clipped, LAMB", ec.base_case(fam, **{
            "parallel.pp": 2, "parallel.dp": 2, "train.grad_clip": 0.5, "train.optimizer": "lamb"})))
        cases.append((f"{fam} pp4 vpp2 interleaved", ec.base_case(fam, **{
            "parallel.pp": 4, "parallel.vpp": 2, "parallel.schedule": "interleaved-1f1b",
            "parallel.microbatches": 8, "train.global_batch_size": 8})))
        cases.append((f"{fam} pp4 vpp2 interleaved, 6 microbatches", ec.base_case(fam, **{
            "parallel.pp": 4, "parallel.vpp": 2, "parallel.schedule": "interleaved-1f1b",
            "parallel.microbatches": 6, "train.global_batch_size": 6})))
    # Dynamic schedules with DP replicas: each replica picks its own task order, yet the DP gradient
    # all-reduces must be issued in one order; and TP peers follow TP rank 0's decisions.
    cases.append(("gpt2 pp2 dp2 vpp2 dpp adaptive", ec.base_case("gpt2", **{
        "parallel.pp": 2, "parallel.dp": 2, "parallel.vpp": 2, "parallel.schedule": "dpp"})))
    cases.append(("llama pp2 dp2 vpp2 dpp dfs, clipped", ec.base_case("llama", **{
        "parallel.pp": 2, "parallel.dp": 2, "parallel.vpp": 2, "parallel.schedule": "dpp",
        "parallel.dpp_policy": "dfs", "train.grad_clip": 0.5})))
    cases.append(("gpt2 tp2 pp2 vpp2 dpp bfs", ec.base_case("gpt2", **{
        "parallel.tp": 2, "parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "dpp",
        "parallel.dpp_policy": "bfs"})))
    # Split backward with tensor and sequence parallelism, and with DP replicas choosing their own orders.
    cases.append(("llama tp2 pp2 zb-h1 sequence-parallel", ec.base_case("llama", **{
        "parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "zb-h1", "parallel.sequence_parallel": True})))
    cases.append(("gpt2 tp2 pp2 zb-h1 sequence-parallel tp-comm-overlap, 4 chunks", ec.base_case("gpt2", **{
        "parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "zb-h1", "parallel.sequence_parallel": True,
        "parallel.tp_comm_overlap": True, "parallel.tp_comm_overlap_chunks": 4})))
    cases.append(("gpt2 pp2 dp2 vpp2 dpp zb, clipped", ec.base_case("gpt2", **{
        "parallel.pp": 2, "parallel.dp": 2, "parallel.vpp": 2, "parallel.schedule": "dpp",
        "parallel.dpp_policy": "zb", "train.grad_clip": 0.5})))
    # The ablation baselines: no DP overlap (buckets reduced after backward), blocking pipeline sends.
    cases.append(("llama pp2 dp2 1f1b, no DP or PP overlap", ec.base_case("llama", **{
        "parallel.pp": 2, "parallel.dp": 2, "parallel.dp_overlap": False, "parallel.pp_overlap": False})))
    # ZeRO-1 with TP (sequence-parallel partial gradients summed on the owned slices), with PP (tied embedding
    # slices summed across stages), clipping and LAMB (norms of whole parameters from DP slices), a dpp schedule.
    cases.append(("llama tp2 dp2 zero1 sequence-parallel", ec.base_case("llama", **{
        "parallel.tp": 2, "parallel.dp": 2, "parallel.zero": 1, "parallel.sequence_parallel": True})))
    cases.append(("gpt2 pp2 dp2 zero1 clipped, LAMB", ec.base_case("gpt2", **{
        "parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 1, "train.grad_clip": 0.5,
        "train.optimizer": "lamb"})))
    cases.append(("gpt2 pp2 dp2 vpp2 dpp zb zero1, clipped", ec.base_case("gpt2", **{
        "parallel.pp": 2, "parallel.dp": 2, "parallel.vpp": 2, "parallel.schedule": "dpp",
        "parallel.dpp_policy": "zb", "parallel.zero": 1, "train.grad_clip": 0.5})))
    return cases


_REFS: dict[str, dict] = {}  # single-process results by case label: the native and regimes tests share them


def _run(world: int, cases: list[tuple[str, dict]], modes: tuple[str, ...]) -> None:
    runs = []
    for label, case in cases:
        for mode in modes:
            if mode == "nccl-lazy" and case["parallel"].get("pp", 1) == 1:
                continue  # no P2P: lazy creation adds nothing to the rules nccl-eager checks (docstring)
            c = copy.deepcopy(case)
            c["parallel"]["comm_semantics"] = mode
            runs.append((f"{label} [{mode}]", c))
    with tempfile.TemporaryDirectory() as tmp:
        spawn(ec.worker, world, [c for _, c in runs], tmp)
        for i, (label, case) in enumerate(runs):
            results = [torch.load(Path(tmp) / f"case{i}_rank{r}.pt", weights_only=False) for r in range(world)]
            key = label.rsplit(" [", 1)[0]
            if key not in _REFS:
                _REFS[key] = ec.reference(case)
            ec.compare(results, _REFS[key], label)


MODES = {"native": ("native",), "nccl regimes": ("nccl-eager", "nccl-lazy")}


@pytest.mark.slow
@pytest.mark.parametrize("modes", MODES.values(), ids=MODES.keys())
def test_two_rank_layouts_match_single_process(modes):
    _run(2, _cases_world2(), modes)


@pytest.mark.slow
@pytest.mark.parametrize("modes", MODES.values(), ids=MODES.keys())
def test_four_rank_layouts_match_single_process(modes):
    _run(4, _cases_world4(), modes)
