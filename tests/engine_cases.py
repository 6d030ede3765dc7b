"""Shared machinery for engine equivalence tests: run configs on real ranks, stitch shards, compare with one process.

Each case trains two optimizer steps, then evaluates the held-out split (forward only). The ranks record the loss
of both steps and the validation loss, every gradient of step 1 and every
parameter after step 2; the test stitches tensor-parallel shards (along `partition_dim`) and pipeline stages back
into full tensors and compares them with the same training done in one process.
"""
from __future__ import annotations

import copy
import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatronapp.config import RunConfig
from megatronapp.parallel import comm


def base_case(family: str = "gpt2", **over: Any) -> dict[str, Any]:
    """A tiny model and batch; `over` sets 'section.field' keys, e.g. {'parallel.tp': 2}."""
    model = dict(family=family, vocab_size=256, hidden_size=32, num_layers=8, num_heads=4, max_seq_len=32)
    if family == "llama":
        model["num_kv_heads"] = 2
    d: dict[str, Any] = {
        "model": model,
        "parallel": dict(tp=1, pp=1, dp=1, vpp=1, microbatches=4, schedule="1f1b"),
        "train": dict(steps=2, global_batch_size=8, seq_len=16, lr=1e-3, warmup_steps=0, grad_clip=0.0,
                      seed=7, progress=False, out="/tmp/megatronapp-unused"),
    }
    for key, value in over.items():
        section, field = key.split(".")
        d[section][field] = value
    return d


def run_case(cfg_dict: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train two steps as `rank`; return what the comparison needs (shards, with their partition dims)."""
    from megatronapp.train.trainer import Trainer

    cfg = RunConfig.from_dict(copy.deepcopy(cfg_dict))
    cfg.train.eval_interval = 1  # builds the held-out split (the loop here is our own: it only sets evaluate up)
    comm.reset()
    tr = Trainer(cfg, rank)
    tr.attach_plugins()  # e.g. a case's fault injection
    try:
        return _two_steps(tr)
    finally:
        tr.detach_plugins()


def _two_steps(tr) -> dict[str, Any]:
    rec1 = tr.train_step()
    if hasattr(tr.reducer, "gather_grads"):  # ZeRO-1 keeps only its slice of the reduced gradient
        tr.reducer.gather_grads()
    grads = {}
    for chunk in tr.chunks:
        for name, p in chunk.named_parameters():
            grads[name] = (p.grad.detach().clone(), getattr(p, "partition_dim", None)
                           if getattr(p, "tensor_parallel", False) else None)
    rec2 = tr.train_step()
    val_loss = tr.evaluate(1)  # after it, the parameters below must still be step 2's (no update)
    params = {name: (p.detach().clone(), getattr(p, "partition_dim", None)
                     if getattr(p, "tensor_parallel", False) else None)
              for chunk in tr.chunks for name, p in chunk.named_parameters()}
    c = tr.topo.coord
    return {"coord": (c.dp, c.pp, c.tp), "losses": [rec1["loss"], rec2["loss"]], "grad_norm": rec1["grad_norm"],
            "val_loss": val_loss, "grads": grads, "params": params}


def worker(rank: int, world: int, cases: list[dict[str, Any]], outdir: str) -> None:
    """Spawned entry: run every case of this world size, save results per (case, rank)."""
    store = dist.distributed_c10d._get_default_store()  # kept: rank 0's store server outlives the worlds below
    for i, case in enumerate(cases):
        if i:
            fresh_world(store, rank, world, f"case{i}")
        torch.save(run_case(case, rank), Path(outdir) / f"case{i}_rank{rank}.pt")


def fresh_world(store: Any, rank: int, world: int, prefix: str) -> None:
    """A new world for the next case, once every rank is done with the last one. Each case builds its own process
    groups and a process keeps them all: after ~25 cases a rank held ~500 threads and ~900 sockets of dead groups,
    and cases late in the list ran 10-20x their time alone, mostly in system time (the suite's nccl-regimes test
    took 433-499 s; the strict comm modes start a thread per P2P op). Destroying the world frees every group; torch
    then reuses the groups' names, so the next world's keys go under a prefix of their own."""
    backend = dist.get_backend()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # as launch.init_distributed's default


def reference(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The same training in this process: tp=pp=dp=1, one microbatch per replica-microbatch of the same size."""
    d = copy.deepcopy(cfg_dict)
    d.pop("inject", None)  # fault drills name ranks of the parallel layout
    p = d["parallel"]
    d["parallel"] = dict(tp=1, pp=1, dp=1, vpp=1, microbatches=p.get("dp", 1) * p.get("microbatches", 1),
                         schedule="1f1b")
    return run_case(d, 0)


def stitch(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    """Full tensors of DP replica 0 from per-rank shards; DP replicas must agree exactly-ish (checked)."""
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for r in results:
        dp, pp, tp = r["coord"]
        for name, (t, dim) in r[key].items():
            if dp != 0:
                continue
            by_name.setdefault(name, {})
            if tp in by_name[name] and not torch.equal(by_name[name][tp], t):
                # the same name on two stages: only the tied embedding copy ("output.weight") may be, and it
                # must then equal the first stage's after synchronisation
                raise AssertionError(f"{name} differs between two pipeline stages")
            by_name[name][tp] = t
            dims[name] = dim
    out = {}
    for name, shards in by_name.items():
        parts = [shards[t] for t in sorted(shards)]
        out[name] = torch.cat(parts, dim=dims[name]) if dims[name] is not None else parts[0]
    return out


def dp_replicas_agree(results: list[dict[str, Any]], key: str, atol: float) -> None:
    base = {(r["coord"][1], r["coord"][2]): r for r in results if r["coord"][0] == 0}
    for r in results:
        ref = base[(r["coord"][1], r["coord"][2])]
        for name, (t, _) in r[key].items():
            torch.testing.assert_close(t, ref[key][name][0], atol=atol, rtol=0,
                                       msg=lambda m, n=name, c=r["coord"]: f"DP replica {c} {key} {n}: {m}")


def compare(results: list[dict[str, Any]], ref: dict[str, Any], label: str,
            atol_grad: float = 2e-5, atol_param: float = 2e-5) -> None:
    """Assert losses, every gradient and every updated parameter equal the single-process run."""
    last = max(results, key=lambda r: r["coord"][1])
    for step in range(2):
        got, want = last["losses"][step], ref["losses"][step]
        assert abs(got - want) < 1e-5, f"{label}: step {step + 1} loss {got} != single-process {want}"
    for r in results:  # every rank knows the validation loss
        assert abs(r["val_loss"] - ref["val_loss"]) < 1e-5, \
            f"{label}: validation loss {r['val_loss']} != single-process {ref['val_loss']} on rank at {r['coord']}"
    for r in results:
        assert abs(r["grad_norm"] - ref["grad_norm"]) < 1e-4 * max(1.0, ref["grad_norm"]), \
            f"{label}: grad norm {r['grad_norm']} != {ref['grad_norm']} on rank at {r['coord']}"
    dp_replicas_agree(results, "grads", atol_grad)
    for key, atol in (("grads", atol_grad), ("params", atol_param)):
        full = stitch(results, key)
        ref_full = {n: t for n, (t, _) in ref[key].items()}
        names = set(full) | {"output.weight"} if "output.weight" in full else set(full)
        for name in names:
            want_name = name if name in ref_full else "embedding.word.weight"
            assert want_name in ref_full, f"{label}: parameter {name} has no single-process counterpart"
            torch.testing.assert_close(full[name], ref_full[want_name], atol=atol, rtol=1e-4,
                                       msg=lambda m, n=name, k=key: f"{label}: {k} of {n}: {m}")
        missing = set(ref_full) - set(full)
        assert not missing, f"{label}: parameters missing from the parallel run: {sorted(missing)}"
