"""The two NCCL communicator regimes, emulated on gloo, must be able to fail, and the engine must pass both.

`--comm-semantics nccl-lazy` (no device_id: the first op of each (group, pair) creates a 2-rank communicator and
blocks until the peer's first op there) and `nccl-eager` (device_id: one stream per group, P2P and collectives
in issue order). The pipeline layout before issue 22 (four channel groups over the whole pipeline column,
`topology.LINKS = "column"`) blocks at step 0 under nccl-lazy at pp 2 (stage 0 first receives gradients, stage 1
first receives activations, on different groups) and under nccl-eager at pp 3 (the middle stage's send to the
last stage queues behind its own receive from the first on one group). The 2-rank links made and warmed up at
start-up train under both, in the same launch (the new layout runs first: a stalled case leaves stuck threads).
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatronapp.launch import spawn
from megatronapp.parallel import comm
from megatronapp.parallel import topology as topology_mod
from tests import engine_cases as ec


def _worker(rank: int, world: int, mode: str, out: str) -> None:
    comm.CONTEXT.stall_timeout_s = 3.0  # the strict modes name a stall after 3 s (reset() keeps it)
    case = ec.base_case("gpt2", **{"parallel.pp": world, "parallel.comm_semantics": mode, "model.num_layers": 6,
                                   "train.global_batch_size": 4})
    result: dict = {}
    for layout in ("pairs", "column"):
        topology_mod.LINKS = layout
        try:
            got = ec.run_case(case, rank)
            result[layout] = {"ok": True, "losses": [float(x) for x in got["losses"]]}
        except Exception as e:  # noqa: BLE001 - the strict mode's report is the result
            result[layout] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    deadline = time.monotonic() + 60  # rank 0 hosts the store: leave when every rank has written
    while rank == 0 and time.monotonic() < deadline and not all(
            Path(out, f"rank{r}.json").exists() for r in range(world)):
        time.sleep(0.05)
    os._exit(0)  # the stalled case's threads cannot be torn down cleanly


def _run(world: int, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, world, mode, out)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def _reference_losses(world: int) -> list[float]:
    case = ec.base_case("gpt2", **{"parallel.pp": world, "model.num_layers": 6, "train.global_batch_size": 4})
    return [float(x) for x in ec.reference(case)["losses"]]


def test_lazy_creation_blocks_the_column_layout_at_pp2_and_not_the_links():
    res = _run(2, "nccl-lazy")
    last = res[-1]["pairs"]
    assert last["ok"], res
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(_reference_losses(2)), atol=2e-5, rtol=0)
    e0, e1 = res[0]["column"], res[1]["column"]
    assert not e0["ok"] and not e1["ok"], res
    # each rank names its own blocked first use and the one its peer is blocked in
    assert "rank 0 blocked" in e0["error"] and "(group pp.grad.down, pair 0:1)" in e0["error"], e0
    assert "rank 1 is itself blocked in recv from rank 0 (group pp.act.up" in e0["error"], e0
    assert "rank 1 blocked" in e1["error"] and "(group pp.act.up, pair 0:1)" in e1["error"], e1
    assert "rank 0 is itself blocked in recv from rank 1 (group pp.grad.down" in e1["error"], e1


def test_eager_streams_stall_the_column_layout_at_pp3_and_not_the_links():
    res = _run(3, "nccl-eager")
    assert all(r["pairs"]["ok"] for r in res), res
    torch.testing.assert_close(torch.tensor(res[-1]["pairs"]["losses"]), torch.tensor(_reference_losses(3)),
                               atol=2e-5, rtol=0)
    assert not any(r["column"]["ok"] for r in res), res
    mid = res[1]["column"]["error"]
    assert "send to rank 2 (group pp.act.up" in mid and "behind recv from rank 0 (group pp.act.up" in mid, mid
    assert "NCCL stream of group pp.act.up [0, 1, 2]" in mid and "nccl-eager" in mid, mid


class _QueuedWork:
    """An NCCL-like work: `wait()` returns at once (it only orders streams); `is_completed()` is the event."""

    def __init__(self) -> None:
        self.fired = False

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.fired


def test_flight_recorder_learns_nccl_completion_from_the_event_not_from_wait():
    from megatronapp.parallel.comm import CommOp, Handle
    from megatronapp.parallel.flight_recorder import RECORDER

    RECORDER.clear()
    RECORDER._rank = 0
    op = CommOp("recv", "pp.act.up", (0, 1), 0, 64, peer=1)
    RECORDER.issue(op)
    work = _QueuedWork()
    h = Handle(work, None, nccl=True, op=op)
    h.wait()  # returns: the op is queued, not done
    assert h.done and [r["key"] for r in RECORDER.snapshot()["open"]] == ["pp.act.up 1->0"]
    work.fired = True  # the CUDA event fires: the next snapshot (or issue) sees it
    snap = RECORDER.snapshot()
    assert snap["open"] == [] and snap["completed"] == {"pp.act.up 1->0": 0}
    RECORDER.clear()


class _HeldWork:
    """A work that completes when its event is set: an op whose peer is late."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def wait(self) -> bool:
        self.release.wait()
        return True


@pytest.mark.parametrize("mode", ["nccl", "nccl-eager"])
def test_an_op_behind_one_of_the_same_direction_and_peer_is_order_not_a_stall(mode):
    # Two receives from one peer in a row: the second waits for the first however late the peer is (NCCL runs
    # them in order and both complete). Under nccl-eager both share the group's one stream, which once made a
    # loaded host's late peer read as a deadlock. A send queued behind the same late receive is one.
    from megatronapp.parallel.nccl_semantics import StreamStall, Strict

    strict = Strict(stall_timeout_s=0.2, mode=mode)
    late = threading.Event()
    outcomes: dict[str, BaseException | None] = {}
    finished = {name: threading.Event() for name in ("first", "second", "send")}

    def submit(name: str, direction: str, work: Any) -> None:
        def done(err: BaseException | None) -> None:
            outcomes[name] = err
            finished[name].set()
        strict.submit([("pp.grad.down", 2)], direction, name, lambda: [work], done)

    submit("first", "recv", _HeldWork(late))
    submit("second", "recv", _HeldWork(late))
    time.sleep(0.6)  # three stall timeouts: the peer is late, nothing is wrong
    late.set()
    assert finished["second"].wait(30) and outcomes == {"first": None, "second": None}, outcomes
    if mode == "nccl-eager":
        strict2 = Strict(stall_timeout_s=0.2, mode=mode)
        held = threading.Event()
        box: list[BaseException | None] = []
        strict2.submit([("pp.act.up", 0)], "recv", "recv from rank 0", lambda: [_HeldWork(held)], lambda e: None)
        strict2.submit([("pp.act.up", 2)], "send", "send to rank 2", lambda: [], box.append)
        deadline = time.monotonic() + 30
        while not box and time.monotonic() < deadline:
            time.sleep(0.05)
        held.set()
        assert box and isinstance(box[0], StreamStall) and "behind recv from rank 0" in str(box[0]), box
