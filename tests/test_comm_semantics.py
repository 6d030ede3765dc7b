"""`--comm-semantics nccl` makes gloo fail where NCCL would hang: it must be able to fail, on real ranks.

- the pipeline's old pattern (every receive of a step posted up front, then the sends, to the same peer) passes
  on plain gloo and is reported as a stream deadlock in the strict mode;
- the same exchange submitted as one group (batch_isend_irecv) passes in the strict mode;
- tags are ignored: messages match in issue order;
- collectives issued in different orders on two members are named, and so is a member that never arrives;
- the DP gradient reducer issues its all-reduces in the same order on every replica even when the replicas'
  final backwards end in different chunk orders (what a dynamic pipeline policy does).

Every case runs in one 2-rank launch (`results`), one after another with `comm.reset()` between them: each case
builds its own groups and the strict mode's store keys carry the run's epoch, so cases cannot see each other's
messages. The cases that leave stalled ops and threads behind (as NCCL would hang) run last.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from megatronapp.launch import spawn
from megatronapp.parallel import comm
from megatronapp.parallel import topology as topology_mod
from megatronapp.parallel.data_parallel import GradReducer


def _old_receive_pattern(rank: int, semantics: str) -> dict:
    """The pre-posted-receive executor in miniature (pp=2, 1F1B, 3 microbatches): each stage posts every
    receive of the step from its neighbour on the pp group with unique tags, then computes and sends."""
    comm.reset()
    comm.set_semantics(semantics, stall_timeout_s=3.0)
    topo = topology_mod.build(1, 2, 1, rank)
    pg, peer, m = topo.pp_group, 1 - rank, 3
    try:
        kind = "B" if rank == 0 else "F"  # stage 0 waits for gradients, stage 1 for activations
        recvs = [(torch.empty(4), i) for i in range(m)]
        handles = [comm.irecv(buf, peer, pg, tag=(i * 2 + (kind == "B"))) for buf, i in recvs]
        sends = []
        for i in range(m):
            if rank == 0:  # forward microbatch i, send its activation
                sends.append(comm.isend(torch.full((4,), float(i)), peer, pg, tag=i * 2))
            else:  # wait for the activation, send the gradient back
                handles[i].wait()
                sends.append(comm.isend(recvs[i][0] * 10, peer, pg, tag=i * 2 + 1))
        for h in handles + sends:
            h.wait()
        return {"ok": True, "got": [buf.tolist() for buf, _ in recvs]}
    except Exception as e:  # noqa: BLE001 - the strict mode's report is the result
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def test_old_pre_posted_receives_pass_on_gloo_but_deadlock_under_nccl_rules(results):
    native = results["old pattern native"]
    assert all(r["ok"] for r in native), native
    assert native[1]["got"] == [[float(i)] * 4 for i in range(3)]
    strict = results["old pattern nccl"]
    assert not any(r["ok"] for r in strict), strict
    # stage 0's activation send is stuck behind its own pre-posted gradient receive; stage 1 waits for it
    e0, e1 = strict[0]["error"], strict[1]["error"]
    assert "send to rank 1" in e0 and "behind recv from rank 1" in e0 and "NCCL stream" in e0, e0
    assert "recv from rank 0" in e1 and "did not complete" in e1, e1


def _exchange(rank: int, grouped: bool) -> dict:
    """Both ranks receive from and send to each other, receive first: NCCL needs this grouped."""
    comm.reset()
    comm.set_semantics("nccl", stall_timeout_s=3.0)
    topo = topology_mod.build(1, 2, 1, rank)
    pg, peer = topo.pp_group, 1 - rank
    inbox, payload = torch.empty(3), torch.full((3,), float(rank + 1))
    try:
        if grouped:
            hs = comm.batch_isend_irecv([comm.P2P("recv", inbox, peer, pg), comm.P2P("send", payload, peer, pg)])
        else:
            hs = [comm.irecv(inbox, peer, pg), comm.isend(payload, peer, pg)]
        for h in hs:
            h.wait()
        return {"ok": True, "got": inbox.tolist()}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": str(e)}


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "ungrouped"])
def test_receive_before_send_needs_a_group(results, grouped):
    res = results[f"exchange {'grouped' if grouped else 'ungrouped'}"]
    if grouped:
        assert res[0] == {"ok": True, "got": [2.0] * 3} and res[1] == {"ok": True, "got": [1.0] * 3}
    else:
        assert not any(r["ok"] for r in res) and all("NCCL stream" in r["error"] for r in res), res


def _tags(rank: int, semantics: str) -> dict:
    comm.reset()
    comm.set_semantics(semantics)
    topo = topology_mod.build(1, 2, 1, rank)
    pg = topo.pp_group
    if rank == 0:
        for h in [comm.isend(torch.full((2,), 1.0), 1, pg, tag=1), comm.isend(torch.full((2,), 2.0), 1, pg, tag=2)]:
            h.wait()
        return {"ok": True}
    a, b = torch.empty(2), torch.empty(2)
    hs = [comm.irecv(b, 0, pg, tag=2), comm.irecv(a, 0, pg, tag=1)]  # posted in the other order
    for h in hs:
        h.wait()
    return {"tag1": a.tolist(), "tag2": b.tolist()}


@pytest.mark.parametrize("semantics", ["native", "nccl"])
def test_tags_are_ignored_under_nccl_rules(results, semantics):
    got = results[f"tags {semantics}"][1]
    if semantics == "native":  # gloo matches by tag
        assert got == {"tag1": [1.0, 1.0], "tag2": [2.0, 2.0]}
    else:  # NCCL matches by order: the first receive posted gets the first message sent
        assert got == {"tag1": [2.0, 2.0], "tag2": [1.0, 1.0]}


def _collectives(rank: int, case: str) -> dict:
    comm.reset()
    comm.set_semantics("nccl", stall_timeout_s=3.0)
    topo = topology_mod.build(1, 1, 2, rank)
    dp = topo.dp_group
    x, y = torch.ones(8), torch.ones(8)
    try:
        comm.all_reduce(torch.ones(2), dp, label="warm-up")  # same on both: must pass
        if case == "swapped":
            pair = [("grad chunk 0", x), ("grad chunk 1", y)]
            for label, t in (pair if rank == 0 else pair[::-1]):
                comm.all_reduce(t, dp, label=label)
        elif case == "missing" and rank == 0:
            comm.all_reduce(x, dp, label="only rank 0")
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def test_collectives_in_different_orders_are_named(results):
    res = results["collectives swapped"]
    for r in res:
        assert not r["ok"]
        e = r["error"]
        assert e.startswith("CollectiveOrderError") and "group dp" in e and "op #1" in e, e
        assert "rank 0: all_reduce[grad chunk 0]" in e and "rank 1: all_reduce[grad chunk 1]" in e, e


def test_a_member_that_never_enters_a_collective_is_named(results):
    res = results["collectives missing"]
    assert res[1] == {"ok": True}
    assert not res[0]["ok"] and "rank(s) [1] did not issue it" in res[0]["error"], res[0]


def _reducer(rank: int) -> dict:
    comm.reset()
    comm.set_semantics("nccl", stall_timeout_s=10.0)
    topo = topology_mod.build(1, 1, 2, rank)
    torch.manual_seed(0)
    chunks = [nn.Linear(4, 4), nn.Linear(4, 4)]  # equal sizes: a swap would go unnoticed without labels
    reducer = GradReducer(chunks, topo.dp_group, bucket_mb=1e-5)  # a bucket per parameter
    reducer.zero_grad()
    x = torch.full((2, 4), float(rank + 1))
    # the two replicas end their chunks' final backwards in opposite orders, as dynamic policies may
    try:
        for c in ([0, 1] if rank == 0 else [1, 0]):
            reducer.before_final_backward(c)
            chunks[c](x * (c + 1)).sum().backward()
            reducer.after_final_backward(c)
        reducer.finish()
        return {"ok": True, "grads": [[p.grad.tolist() for p in ch.parameters()] for ch in chunks]}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def test_dp_reduction_order_is_fixed_whatever_the_backward_order(results):
    res = results["reducer"]
    assert all(r["ok"] for r in res), res
    assert res[0]["grads"] == res[1]["grads"]
    # the average of both replicas' gradients, chunk by chunk: 2 rows of (rank + 1) * (c + 1), mean over ranks
    for c in range(2):
        w = torch.tensor(res[0]["grads"][c][0])
        assert torch.allclose(w, torch.full((4, 4), 3.0 * (c + 1)))


def _tensor_collectives(rank: int, semantics: str) -> dict:
    """The TP gather and reduce-scatter along the sequence (dim 1) and dim 0. Under NCCL's rules they must use
    NCCL's single-tensor forms (issue 39, item 8): the list forms, which make NCCL flatten and copy, are refused
    there; plain gloo keeps its own forms, with the same results."""
    import torch.distributed as dist

    comm.reset()
    comm.set_semantics(semantics, stall_timeout_s=10.0)
    tp = topology_mod.build(2, 1, 1, rank).tp_group

    def refused(*a, **k):
        raise AssertionError("a list-based collective")

    saved = dist.all_gather, dist.reduce_scatter
    if semantics != "native":
        dist.all_gather, dist.reduce_scatter = refused, refused
    try:
        x = torch.arange(12.0).view(1, 3, 4) + 100 * rank  # [b, s/tp, h]
        full = comm.all_gather(x, tp, dim=1)
        rows = comm.all_gather(x[0], tp, dim=0)
        mine = comm.reduce_scatter(torch.arange(24.0).view(1, 6, 4) * (rank + 1), tp, dim=1)
        stacked, h = comm.all_gather_async(x, tp)
        h.wait()
        part, h = comm.reduce_scatter_async(torch.arange(16.0).view(2, 2, 4) * (rank + 1), tp, dim=0)
        h.wait()
        return {"ok": True, "full": full.tolist(), "rows": rows.tolist(), "mine": mine.tolist(),
                "stacked": stacked.tolist(), "part": part.tolist()}
    finally:
        dist.all_gather, dist.reduce_scatter = saved


@pytest.mark.parametrize("semantics", ["native", "nccl"])
def test_tp_collectives_use_single_tensor_forms(results, semantics):
    res = results[f"tensor collectives {semantics}"]
    assert all(r.get("ok") for r in res), res
    x = [torch.arange(12.0).view(1, 3, 4) + 100 * r for r in range(2)]
    for rank, r in enumerate(res):
        assert r["full"] == torch.cat(x, dim=1).tolist()
        assert r["rows"] == torch.cat([t[0] for t in x], dim=0).tolist()
        assert r["mine"] == (torch.arange(24.0).view(1, 6, 4) * 3).chunk(2, dim=1)[rank].tolist()
        assert r["stacked"] == torch.stack(x).tolist()
        assert r["part"] == (torch.arange(16.0).view(2, 2, 4) * 3)[rank:rank + 1].tolist()


# Cases in launch order: the clean ones first; the last two leave stalled ops and threads behind, as NCCL would hang.
CASES: dict[str, tuple] = {
    "tensor collectives native": (_tensor_collectives, "native"),
    "tensor collectives nccl": (_tensor_collectives, "nccl"),
    "old pattern native": (_old_receive_pattern, "native"),
    "exchange grouped": (_exchange, True),
    "tags native": (_tags, "native"),
    "tags nccl": (_tags, "nccl"),
    "reducer": (_reducer,),
    "collectives swapped": (_collectives, "swapped"),
    "collectives missing": (_collectives, "missing"),
    "exchange ungrouped": (_exchange, False),
    "old pattern nccl": (_old_receive_pattern, "nccl"),
}


def _every_case(rank: int, world: int, out: str) -> None:
    result = {}
    for name, (fn, *args) in CASES.items():
        try:
            result[name] = fn(rank, *args)
        except Exception as e:  # noqa: BLE001 - a crashed case fails its own test, not the others'
            result[name] = {"crashed": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json.tmp").write_text(json.dumps(result))
    os.replace(Path(out, f"rank{rank}.json.tmp"), Path(out, f"rank{rank}.json"))
    # Rank 0 hosts the job's store: it leaves only when every rank has its result (a file barrier: the process
    # groups of the stalled cases are stuck, which is their point).
    deadline = time.monotonic() + 60
    while rank == 0 and time.monotonic() < deadline and not all(
            Path(out, f"rank{r}.json").exists() for r in range(world)):
        time.sleep(0.05)
    # A rank whose ops are stuck cannot tear gloo down cleanly: leave at once.
    os._exit(0)


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """Every case's result on each rank, from one 2-rank launch."""
    with tempfile.TemporaryDirectory() as out:
        spawn(_every_case, 2, out)
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    return {name: [r[name] for r in per_rank] for name in CASES}
