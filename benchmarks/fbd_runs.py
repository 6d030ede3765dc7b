"""The runs MegaFBD's benchmarks measure (bench_fbd, and fbd_emulated on emulated devices): the bench model's
config per backward layout, the spawned rank that trains it and records what autograd keeps for backward, and the
step time of a run (a step ends when its slowest rank's does)."""
from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from benchmarks import harness
from megatronapp.config import RunConfig
from megatronapp.parallel import comm

# Device seconds of a middle virtual stage's forward of one microbatch (2 layers). 20 ms left the 8-rank run
# (4 forward instances) out of the accelerator regime under load (host share 1.17 at load average 30-50).
EMU_FORWARD_S = 0.04


class SavedBytes:
    """Peak bytes of tensors autograd holds for backward (by storage, weights excluded)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.weights = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.weights:
            return t
        return _Held(self, t, ptr)

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("owner", "t", "ptr")

    def __init__(self, owner: SavedBytes, t: torch.Tensor, ptr: int):
        self.owner, self.t, self.ptr = owner, t, ptr
        n = owner.refs.get(ptr, 0)
        owner.refs[ptr] = n + 1
        if n == 0:
            owner.live += t.untyped_storage().nbytes()
            owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        o = self.owner
        o.refs[self.ptr] -= 1
        if o.refs[self.ptr] == 0:
            del o.refs[self.ptr]
            o.live -= self.t.untyped_storage().nbytes()


def config(layout: str, fbd: bool, steps: int) -> dict[str, Any]:
    """The bench model (a small GPT-2, 8 microbatches) at a backward layout, coupled or MegaFBD."""
    par = {"tp2pp2": dict(tp=2, pp=2), "pp4": dict(tp=1, pp=4)}[layout]
    d = {"model": dict(family="gpt2", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, max_seq_len=64),
         "parallel": dict(dp=1, microbatches=8, schedule="1f1b", **par),
         "train": dict(steps=steps, global_batch_size=16, seq_len=32, lr=1e-3, warmup_steps=0, grad_clip=1.0,
                       seed=3, progress=False, out="/tmp/megatronapp-bench-fbd")}
    if fbd:
        d["parallel"].update(fbd=True, fbd_forward_tp=1, fbd_forward_pp=1, fbd_forward_instances=1)
    return d


def worker(rank: int, world: int, cfg_dict: dict[str, Any], outdir: str) -> None:
    """Spawned entry: train the config's steps; report step times, saved bytes, role, stage and emulation."""
    cfg = RunConfig.from_dict(copy.deepcopy(cfg_dict))
    comm.reset()
    if cfg.parallel.fbd:
        from megatronapp.fbd.run import build_rank

        r = build_rank(cfg, rank)
        role = r.role
    else:
        from megatronapp.train.trainer import Trainer

        r, role = Trainer(cfg, rank), "coupled"
    saved = SavedBytes(list(getattr(r, "params", [])))  # forward ranks run without autograd: nothing saved
    times = []
    for _ in range(cfg.train.steps):
        t0 = time.perf_counter()
        with saved.hooks():
            r.train_step()
        times.append(time.perf_counter() - t0)
    r.close()
    stage = r.topo.coord.pp if role != "forward" else None
    emulated = r.emulation.record()
    params = sum(q.numel() for q in getattr(r, "params", []))
    harness.report(outdir, rank, {"rank": rank, "role": role, "stage": stage, "peak_saved_bytes": saved.peak,
                                  "step_times": times, "emulation": emulated, "params": params})


def measure(layout: str, fbd: bool, steps: int, cfg: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Launch one run (the layout's config, or `cfg`); every rank's record."""
    cfg = cfg or config(layout, fbd, steps)
    world = RunConfig.from_dict(copy.deepcopy(cfg)).parallel.total_ranks
    return harness.launch(worker, world, cfg)


def step_time(ranks: list[dict[str, Any]]) -> float:
    """Median step time after the first step; a step ends when its slowest rank's does."""
    per_step = list(zip(*[r["step_times"] for r in ranks]))
    return statistics.median(max(s) for s in per_step[1:] or per_step)
