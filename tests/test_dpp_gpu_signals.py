"""What MegaDPP reads and exchanges per task costs no host-device synchronisation, and its memory signal is right on a
GPU (issue 39, items 4 and 6). With TP, TP rank 0's per-task choice reaches its peers as three ints on a host (gloo)
group, never as a pickled object over NCCL; the memory headroom counts the caching allocator's unused memory."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatronapp.config import RunConfig
from megatronapp.parallel import comm, topology
from megatronapp.pipeline.executor import PipelineExecutor
from megatronapp.pipeline.tasks import Task
from megatronapp.train.trainer import make_policy


def _executor(rank: int) -> PipelineExecutor:
    cfg = RunConfig.from_dict({"parallel": {"tp": 2, "schedule": "dpp", "microbatches": 2}})
    topo = topology.build(2, 1, 1, rank=rank)
    return PipelineExecutor([torch.nn.Identity()], topo, make_policy(cfg), microbatches=2, act_shape=(1, 2, 4))


def test_tp_peers_share_the_choice_as_ints_on_the_control_group(monkeypatch):
    sent: list[tuple[str, torch.Tensor, int]] = []

    def broadcast(t: torch.Tensor, src: int, group) -> torch.Tensor:
        sent.append((group.name, t.clone(), src))
        if t.device.type == "cpu" and len(sent) > 1:  # the peer's side: TP rank 0 chose B0.1
            t.copy_(torch.tensor([1, 0, 1]))
        return t

    def no_object(*a, **k):
        raise AssertionError("a pickled object broadcast per task")

    monkeypatch.setattr(comm, "broadcast", broadcast)
    monkeypatch.setattr(comm, "broadcast_object", no_object)
    monkeypatch.setattr(comm.CONTEXT, "backend", lambda group: "gloo")
    lead = _executor(0)
    assert lead.decide_on_tp0
    st = lead._begin([(torch.zeros(1, 2, dtype=torch.long),) * 2] * 2, 0.5)
    task = lead._next_task(st)
    assert task == Task("F", 0, 0) and sent[0][0] == "tp" and sent[0][1].tolist() == [0, 0, 0]
    peer = _executor(1)
    st = peer._begin([(torch.zeros(1, 2, dtype=torch.long),) * 2] * 2, 0.5)
    monkeypatch.setattr(PipelineExecutor, "_wait_input", lambda self, st, t: None)
    assert peer._next_task(st) == Task("B", 0, 1)
    assert all(t.dtype == torch.int64 and t.device.type == "cpu" and src == 0 for _, t, src in sent)


def test_an_nccl_tp_group_gets_a_gloo_control_group(monkeypatch):
    made: list[tuple[list[int], dict]] = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(dist, "get_backend", lambda pg=None: "gloo" if pg == ("pg", "gloo") else "nccl")
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or ("pg", kw.get("backend")))
    topo = topology.build(2, 1, 2, tp_control=True)
    ctl = topo.tp_control_group
    assert ctl.name == "tp.ctl" and ctl.ranks == (0, 1) and ctl.pg == ("pg", "gloo")
    ranks, kw = made[-1]
    assert ranks == [0, 1] and kw["backend"] == "gloo" and kw["use_local_synchronization"]
    assert kw.get("timeout") is None  # torch's default timeout unless the caller gives one
    made.clear()
    plain = topology.build(2, 1, 2)  # static schedules decide nothing at run time: no extra group
    assert plain.tp_control_group is plain.tp_group and all(kw.get("backend") is None for _, kw in made)


def test_the_memory_signal_counts_the_allocator_cache_as_free(monkeypatch):
    """MegaDPP's memory pressure (issue 39, item 6): 80 GB card, 70 GB reserved by the caching allocator of which
    20 GB hold tensors. The driver sees 10 GB free; the next allocations can have 60 GB."""
    gb = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gb, 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 70 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * gb)
    cfg = RunConfig.from_dict({"parallel": {"schedule": "dpp", "microbatches": 2}})
    ex = PipelineExecutor([torch.nn.Identity()], topology.build(1, 1, 1), make_policy(cfg), microbatches=2,
                          act_shape=(1, 2, 4), device="cuda")
    assert ex._headroom() == 60 / 80  # not 10 / 80, which the DPP policies read as pressure (< 0.1)
    assert PipelineExecutor([torch.nn.Identity()], topology.build(1, 1, 1), make_policy(cfg), microbatches=2,
                            act_shape=(1, 2, 4))._headroom() is None  # no GPU, no signal
