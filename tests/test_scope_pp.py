"""MegaScope serving the default model split over pipeline stages (and tp x pp) from real gloo ranks: each
layout serves every request under gloo's native rules and under NCCL's rules in both communicator regimes
(`nccl-lazy`, `nccl-eager`), in one launch (groups rebuilt between them), with the same tokens, probabilities and
captured states as one process, perturbations of every kind included, a failure on a worker rank reported and
survived in lockstep."""
from __future__ import annotations

import pytest
import torch

from megatronapp.launch import spawn
from megatronapp.scope import distributed
from megatronapp.scope import generate as gen_mod
from tests.scope_cases import CAPTURE, compare, reference, same_as_checkpoint, write_checkpoint

REQUESTS = [
    {"type": "generate", "prompts": ["Hello", "The quick"], "max_new_tokens": 3, "greedy": True,
     "capture": CAPTURE},
    {"type": "generate", "prompts": ["ab"], "max_new_tokens": 4, "temperature": 0.8, "top_k": 20, "seed": 7,
     "capture": CAPTURE, "perturbations": [
         {"kind": "gaussian", "place": "hidden", "layers": [1], "strength": 0.5, "seed": 3},
         {"kind": "bitflip", "place": "weight", "target": "attn.qkv.weight", "layers": [2], "indices": [5, 40000],
          "bit": 30},
         {"kind": "uniform", "place": "activation", "target": "attn.q", "layers": [0, 3], "heads": [1, 2],
          "strength": 0.5, "rate": 0.5, "seed": 1}]},
]
FAULT_SEED = 666  # rank 1 raises while sampling for this seed (a failure on a worker only)


MODES = ("native", "nccl-lazy", "nccl-eager")


def _rank(rank: int, world: int, tp: int, pp: int, out: str, checkpoint: str) -> None:
    for semantics in MODES:
        _serve_once(rank, tp, pp, f"{out}.{semantics}", checkpoint, semantics)


def _serve_once(rank: int, tp: int, pp: int, out: str, checkpoint: str, semantics: str) -> None:
    from megatronapp.parallel import comm, topology

    comm.reset()
    comm.set_semantics(semantics, stall_timeout_s=60)
    topo = topology.build(tp, pp, 1)
    sm = distributed.load_shard(None, topo)
    # a checkpoint trained without pipeline parallelism, cut into these stages (the last takes the tied weight)
    same = same_as_checkpoint(sm, topo, checkpoint)
    weights = {n: p.detach().clone() for n, p in sm.model.named_parameters()}
    if rank == 1 and not hasattr(gen_mod._sample, "faulty"):
        real = gen_mod._sample

        def faulty(logits, req, g):
            if req.seed == FAULT_SEED:
                raise RuntimeError("injected fault on rank 1")
            return real(logits, req, g)
        faulty.faulty = True  # type: ignore[attr-defined]
        gen_mod._sample = faulty
    if rank != 0:
        distributed.worker_loop(sm, topo)
        restored = all(torch.equal(p, weights[n]) for n, p in sm.model.named_parameters())
        torch.save({"restored": restored, "checkpoint": same}, f"{out}.{rank}")
        return
    run = distributed.lockstep_runner(topo)
    res: dict = {"runs": [], "describe": sm.describe()}
    try:
        for req in REQUESTS:
            msgs: list[dict] = []
            run(sm, gen_mod.Generate.model_validate(req), msgs.append)
            res["runs"].append(msgs)
        try:
            run(sm, gen_mod.Generate.model_validate({**REQUESTS[0], "seed": FAULT_SEED, "greedy": False}),
                lambda m: None)
        except Exception as e:  # noqa: BLE001
            res["fault"] = f"{type(e).__name__}: {e}"
        msgs = []
        run(sm, gen_mod.Generate.model_validate(REQUESTS[0]), msgs.append)  # still in lockstep
        res["after_fault"] = msgs
    finally:
        distributed.shutdown(topo)
    res["restored"] = all(torch.equal(p, weights[n]) for n, p in sm.model.named_parameters())
    res["checkpoint"] = same
    torch.save(res, f"{out}.0")


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_serving_matches_single_process(tmp_path, tp, pp):
    out = str(tmp_path / "res")
    spawn(_rank, tp * pp, tp, pp, out, write_checkpoint(str(tmp_path / "ckpt"), tp))
    for semantics in MODES:
        _check(f"{out}.{semantics}", tp, pp)


def _check(out: str, tp: int, pp: int) -> None:
    res = torch.load(f"{out}.0")
    assert res["describe"]["name"] == f"embedded gpt2-tiny (tp={tp}, pp={pp})"
    for got, req in zip(res["runs"], REQUESTS):
        compare(got, reference(req))
    assert "rank 1 failed: RuntimeError: injected fault on rank 1" in res["fault"]
    compare(res["after_fault"], reference(REQUESTS[0]))
    workers = [torch.load(f"{out}.{r}") for r in range(1, tp * pp)]
    assert res["restored"] and all(w["restored"] for w in workers)
    assert res["checkpoint"] and all(w["checkpoint"] for w in workers)
