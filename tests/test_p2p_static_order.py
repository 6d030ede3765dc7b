"""A static schedule's receiver knows each channel's message order: on NCCL it neither polls `is_completed()` nor
reads a header on the host per message; the headers are checked once at the end of the step (issue 39, item 3).

The receives here stand in for NCCL's: `is_completed()` would query a CUDA event, `wait()` only orders the compute
stream. The sender is simulated from its own schedule, as `PipelineExecutor` sends (the next virtual stage's chunk).
"""
from __future__ import annotations

import pytest
import torch

from megatronapp.parallel import comm, topology
from megatronapp.pipeline.p2p import HEADER_BYTES, StageLinks
from megatronapp.pipeline.schedules import StaticPolicy, stage_orders
from megatronapp.pipeline.tasks import StageView

PP, VPP, M = 2, 2, 4
SHAPE = (1, 2, 3)


class _NcclRecv:
    orders_stream, blocks_host = True, False

    def __init__(self, calls: dict[str, int]):
        self.calls = calls

    def is_completed(self) -> bool:
        self.calls["polls"] += 1
        return True

    def wait(self) -> None:
        self.calls["waits"] += 1


def _sent_by(stage: int) -> dict[str, list[tuple[str, int, int]]]:
    """What `stage` sends, per channel kind, in its issue order: F of every virtual stage but the last (to the
    next stage's chunk), B of every virtual stage but the first (to the previous stage's chunk)."""
    out: dict[str, list] = {"F": [], "B": []}
    for t in stage_orders("interleaved-1f1b", PP, VPP, M)[stage]:
        v = t.chunk * PP + stage
        if t.kind == "F" and v != PP * VPP - 1:
            out["F"].append(("F", t.chunk + 1 if stage == PP - 1 else t.chunk, t.microbatch))
        elif t.kind == "B" and v != 0:
            out["B"].append(("B", t.chunk - 1 if stage == 0 else t.chunk, t.microbatch))
    return out


def _links(monkeypatch, calls, swap: bool = False) -> tuple[StageLinks, StaticPolicy]:
    """Stage 1's links, fed by stage 0 (both its neighbours when pp = 2) in stage 0's order."""
    topo = topology.build(1, PP, 1, rank=1)
    links = StageLinks(topo, SHAPE, torch.float32, torch.device("cpu"))
    queues = _sent_by(0)
    if swap:
        queues["F"][1], queues["F"][2] = queues["F"][2], queues["F"][1]
    by_group = {links.inbound[k].group.name: queues[k] for k in ("F", "B")}

    def irecv(buf: torch.Tensor, src: int, group) -> _NcclRecv:
        kind, chunk, mb = by_group[group.name].pop(0)
        buf[:HEADER_BYTES].view(torch.int32).copy_(torch.tensor([0, "FB".index(kind), chunk, mb]))
        buf[HEADER_BYTES:].view(torch.float32).fill_(100 * "FB".index(kind) + 10 * chunk + mb)
        return _NcclRecv(calls)

    monkeypatch.setattr(comm, "irecv", irecv)

    def no_host_header(*a):
        raise AssertionError("a header was read on the host per message")

    monkeypatch.setattr(StageLinks, "_header", no_host_header)
    policy = StaticPolicy("interleaved-1f1b")
    policy.reset(StageView(stage=1, pp=PP, vpp=VPP, microbatches=M))
    expected = {k: len(v) for k, v in policy.arrivals.items()}
    links.start(0, expected, window=2, order=policy.arrivals)
    return links, policy


def _run(links: StageLinks, policy: StaticPolicy) -> None:
    """Stage 1 takes its inputs in its own order, as the executor does."""
    for t in policy.order:
        v = t.chunk * PP + 1
        if (t.kind == "F" and v != 0) or (t.kind == "B" and v != PP * VPP - 1):
            key = (t.kind, t.chunk, t.microbatch)
            links.wait_for(key, 5.0, lambda: "test")
            payload = links.take(key)
            assert payload.shape == SHAPE
            assert float(payload.flatten()[0]) == 100 * "FB".index(t.kind) + 10 * t.chunk + t.microbatch


def test_known_order_receives_need_no_host_poll_and_no_header_read_per_message(monkeypatch):
    calls = {"polls": 0, "waits": 0}
    links, policy = _links(monkeypatch, calls)
    assert len(policy.arrivals["F"]) == 2 * M and len(policy.arrivals["B"]) == M
    _run(links, policy)
    links.finish()  # every header checked here, at once
    assert calls["polls"] == 0
    assert calls["waits"] == 3 * M  # each receive ordered before its use, on the device


def test_a_message_out_of_the_static_order_fails_the_step(monkeypatch):
    calls = {"polls": 0, "waits": 0}
    links, policy = _links(monkeypatch, calls, swap=True)
    with pytest.raises((RuntimeError, AssertionError)):
        _run(links, policy)  # a payload filed under the wrong key is seen here ...
        links.finish()  # ... and always here: the headers disagree with the order
    links2, policy2 = _links(monkeypatch, calls, swap=True)
    for kind in ("F", "B"):
        for key in policy2.arrivals[kind]:
            links2.wait_for(key, 5.0, lambda: "test")
            links2.take(key)
    with pytest.raises(RuntimeError, match="out of order on the F channel"):
        links2.finish()


def test_a_wait_decided_by_nccl_receives_polls_at_most_every_200_us(monkeypatch):
    """A dynamic policy must poll NCCL receives (they signal nothing): the back-off is capped at NCCL_POLL_MAX_S,
    not the 2 ms that suits gloo, whose watchers wake the waiter."""
    from megatronapp.parallel import comm_handle

    sleeps: list[float] = []
    monkeypatch.setattr(comm_handle._progress, "wait", lambda timeout=None: sleeps.append(timeout))
    topo = topology.build(1, PP, 1, rank=1)
    links = StageLinks(topo, SHAPE, torch.float32, torch.device("cpu"))

    class _Late(_NcclRecv):
        def is_completed(self) -> bool:
            return len(sleeps) > 40

    links.inbound["F"].posted.append((torch.empty(0), _Late({"polls": 0, "waits": 0})))
    monkeypatch.setattr(StageLinks, "poll", lambda self: True)
    links.wait_any(5.0, lambda: "test")
    assert max(sleeps) <= comm.NCCL_POLL_MAX_S < comm.POLL_MAX_S
