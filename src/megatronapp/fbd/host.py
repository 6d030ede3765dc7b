"""What plug-ins and the run loop see of one MegaFBD rank, forward or backward: the trainer's face.

Plug-ins (`--trace`, `--inject`, `--attach`) are written against the engine's `Trainer`: they read `cfg`, `rank`,
`out`, `step`, `chunks`, `topo` and register lifecycle hooks on `hooks`. `RankHost` offers the same names for
both roles, so the engine's plug-ins attach to an FBD run unchanged, fired by the same `plugins.Hooks`. It is
also the role the engine's run loop drives (`train/loop.RankRole`: train_step, evaluate, save, ...), delegating
to the `BackwardRank` or `ForwardRank` doing the work; so logging, validation, MFU, checkpoint timing and the
summary of an FBD run are the engine's own.

`topo` is the job's trace grid, not the backward layout: its `world_size` counts every rank of the job and its
"world" group holds all of them (the tracer's clock handshake and the fault drills' rank checks need the whole
job). Coordinates (dp, pp, tp) are the engine's on backward ranks; forward instance k, forward stage s, TP rank
t sits at (dp=k, pp=pp+s, tp=t): forward stages come after the backward stages, instances are replicas of each
other like DP replicas are. So MegaScan compares forward ranks with forward ranks only (its peers are ranks of
one "stage") and never mixes roles. The role itself is in the trace header (`fbd_role`) and the process name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatronapp.config import plugin_entries
from megatronapp.fbd.layout import FbdLayout
from megatronapp.parallel.topology import Coord, Group, coord_of
from megatronapp.train import plugins


@dataclass
class JobGrid:
    """Topology-shaped view of the whole FBD job (what tracer and fault drills read of `trainer.topo`)."""

    rank: int
    world_size: int
    coord: Coord
    tp: int
    pp: int
    dp: int
    groups: dict[str, Group] = field(default_factory=dict)


def grid_coord(layout: FbdLayout, rank: int) -> Coord:
    """The (dp, pp, tp) a rank has in traces: its engine coordinate, or (instance, pp + stage, tp) if forward."""
    if layout.is_forward(rank):
        k, s, t = layout.forward_coord(rank)
        return Coord(dp=k, pp=layout.pp + s, tp=t)
    return coord_of(rank, layout.tp, layout.pp, layout.dp)


def stage_work(layout: FbdLayout) -> dict[int, float]:
    """Expected self time of each trace stage relative to a backward stage (a cost model, for MegaScan's view of
    stages without peers): a backward stage recomputes the forward and runs the backward of its vpp chunks for
    every microbatch of its replica (~3 forward-equivalents per chunk, split over tp); a forward stage runs one
    no-grad forward per virtual stage it holds (split over tp_f) for the dp/n_f share of all replicas' jobs its
    instance serves. A forward stage with nothing to compute is left out (it only waits)."""
    work = {s: 1.0 for s in range(layout.pp)}
    share = layout.dp * layout.tp / (layout.n_f * layout.tp_f)
    for s in range(layout.pp_f):
        if layout.forward_segments(s):
            work[layout.pp + s] = len(layout.forward_segments(s)) / (3.0 * layout.vpp) * share
    return work


def role_label(layout: FbdLayout, rank: int) -> str:
    """`forward k0 s1 t0` or `backward dp0 pp1 tp1`: the rank's role and its place in that role's layout."""
    if layout.is_forward(rank):
        k, s, t = layout.forward_coord(rank)
        return f"forward k{k} s{s} t{t}"
    c = grid_coord(layout, rank)
    return f"backward dp{c.dp} pp{c.pp} tp{c.tp}"


class RankHost:
    """The trainer-shaped object plug-ins of an FBD rank are called with (`plugin(host)`), and the run loop's role."""

    def __init__(self, cfg: Any, layout: FbdLayout, rank: int, role_rank: Any, world_group: Group):
        self.cfg, self.layout, self.rank, self.role = cfg, layout, rank, role_rank.role
        self.worker = role_rank  # the BackwardRank or ForwardRank doing the work
        self.out = Path(cfg.train.out)
        self.hooks: plugins.Hooks = getattr(role_rank, "hooks", None) or plugins.Hooks()
        backward = self.role == "backward"
        self.reports_loss = role_rank.reports_loss  # a forward rank computes no loss: the loop logs nothing there
        self.device, self.emulation = role_rank.device, role_rank.emulation
        self.optimizer = role_rank.optimizer if backward else None  # forward ranks hold no state
        self.save_stalls: list[float] = role_rank.save_stalls if backward else []
        p = cfg.parallel
        self.topo = JobGrid(rank, layout.total, grid_coord(layout, rank), tp=max(p.tp, layout.tp_f),
                            pp=layout.pp + layout.pp_f, dp=max(layout.dp, layout.n_f), groups={"world": world_group})
        self.label = role_label(layout, rank)
        # read by the MegaScan tracer into the rank's trace header (process name and role in the merged trace)
        self.trace_header = {"process_name": f"rank {rank} {self.label}", "fbd_role": self.role,
                             "fbd_layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "vpp": layout.vpp,
                                            "tp_f": layout.tp_f, "pp_f": layout.pp_f, "n_f": layout.n_f},
                             "stage_work": stage_work(layout)}

    @property
    def step(self) -> int:
        return self.worker.step

    @property
    def chunks(self) -> list[Any]:
        """The model pieces this rank holds: backward chunks, or the forward instance's stage segments."""
        w = self.worker
        return list(w.chunks) if hasattr(w, "chunks") else list(w.segments.values())

    def attach_plugins(self) -> None:
        """Resolve and call every plug-in of the config in order, then fire `rank_start` (as the Trainer's)."""
        plugins.attach(self, plugin_entries(self.cfg))

    def detach_plugins(self, raise_errors: bool = True) -> None:
        plugins.detach(self.hooks, raise_errors)

    # -- the run loop's role: the worker's step; checkpoints and validation on backward ranks only ----------
    def train_step(self) -> dict[str, float]:
        return self.worker.train_step()

    def evaluate(self) -> float:
        """The validation loss (backward ranks: the loop never asks a rank that reports no loss)."""
        return self.worker.evaluate()

    def save(self) -> Path | None:
        """A checkpoint of the backward layout (the engine's format); forward ranks save nothing."""
        return self.worker.save() if self.role == "backward" else None

    def finish_saves(self) -> None:
        if self.role == "backward":
            self.worker.finish_saves()

    def close(self) -> None:
        self.worker.close()
