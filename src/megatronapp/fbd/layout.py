"""Where every rank of a MegaFBD job sits, and the pure mappings between the backward and forward layouts.

Backward instances are an ordinary engine layout (tp x pp x dp, vpp chunks per stage) on global ranks
0..Wb-1. Forward instances follow on ranks Wb..: instance k, forward stage s, TP rank t is rank
Wb + k * (pp_f * tp_f) + s * tp_f + t.

Forward stages are a regrouping of whole backward *virtual* stages: with V = pp * vpp virtual stages, forward
stage s holds virtual stages v with v * pp_f // V == s (consecutive runs of V / pp_f). A forward instance never
computes the last virtual stage: its output is only needed for the loss, which the backward side recomputes.
The input of virtual stage v > 0 is sent by the forward stage that computes virtual stage v - 1.

Everything here is a pure function of the layout (and of parameter shapes), so both ends of every transfer
compute the same plan without talking, and the plan is unit-tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatronapp.parallel.topology import Coord, coord_of, rank_of


@dataclass(frozen=True)
class FbdLayout:
    """Backward tp x pp x dp (vpp chunks per stage) plus n_f forward instances of tp_f x pp_f."""

    tp: int
    pp: int
    dp: int
    vpp: int
    tp_f: int
    pp_f: int
    n_f: int
    microbatches: int

    @property
    def backward_world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def instance_size(self) -> int:
        return self.tp_f * self.pp_f

    @property
    def total(self) -> int:
        return self.backward_world + self.n_f * self.instance_size

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    # -- ranks ----------------------------------------------------------------------------------------------
    def is_forward(self, rank: int) -> bool:
        return rank >= self.backward_world

    def forward_rank(self, instance: int, stage: int, tp: int) -> int:
        return self.backward_world + instance * self.instance_size + stage * self.tp_f + tp

    def forward_coord(self, rank: int) -> tuple[int, int, int]:
        """(instance, forward stage, forward tp rank) of a forward rank."""
        i = rank - self.backward_world
        if not 0 <= i < self.n_f * self.instance_size:
            raise ValueError(f"rank {rank} is not a forward rank of {self}")
        instance, rest = divmod(i, self.instance_size)
        stage, tp = divmod(rest, self.tp_f)
        return instance, stage, tp

    def backward_rank(self, dp: int, stage: int, tp: int) -> int:
        return rank_of(Coord(dp=dp, pp=stage, tp=tp), self.tp, self.dp)

    # -- work assignment ------------------------------------------------------------------------------------
    def instance_of(self, dp: int, microbatch: int) -> int:
        """The forward instance that runs microbatch `microbatch` of DP replica `dp` (round robin over jobs)."""
        return (microbatch * self.dp + dp) % self.n_f

    def jobs(self, instance: int) -> list[tuple[int, int]]:
        """(dp replica, microbatch) pairs an instance runs, in its order: microbatch-major, so every backward
        replica gets its first inputs early."""
        return [(d, m) for m in range(self.microbatches) for d in range(self.dp) if self.instance_of(d, m) == instance]

    def forward_stage_of(self, v: int) -> int:
        """The forward stage holding virtual stage v (the regrouping of consecutive virtual stages)."""
        return v * self.pp_f // self.virtual_stages

    def forward_segments(self, stage: int) -> list[int]:
        """Virtual stages a forward stage computes (never the last one: its output only feeds the loss)."""
        return [v for v in range(self.virtual_stages - 1) if self.forward_stage_of(v) == stage]

    def input_sender(self, v: int, instance: int, tp: int) -> int:
        """Global forward rank that sends backward TP rank `tp` the input of virtual stage v > 0: forward TP rank
        tp * tp_f // tp (with tp_f = tp its own peer; with tp_f < tp every forward TP rank holds the whole hidden
        state, so the tp / tp_f backward ranks of each block share one sender and the sending is spread)."""
        if v < 1:
            raise ValueError("virtual stage 0 reads token ids itself")
        return self.forward_rank(instance, self.forward_stage_of(v - 1), tp * self.tp_f // self.tp)

    def input_part(self, tp: int, sequence_parallel: bool) -> int | None:
        """Which of `self.tp` equal sequence slices of the sender's hidden state backward TP rank `tp` takes, or
        None for the whole state. Under sequence parallelism a backward TP rank works on its slice; a forward
        instance with tp_f = tp runs sequence-parallel itself and already holds exactly that slice, one with
        tp_f < tp runs without it (whole sequence on every forward TP rank) and sends each backward rank its
        slice: the input is re-split along the sequence."""
        if not sequence_parallel or self.tp == 1 or self.tp_f == self.tp:
            return None
        return tp

    def input_receivers(self, v: int, dp: int) -> list[int]:
        """Backward ranks (one per TP rank, in TP order) that take the input of virtual stage v of replica dp."""
        return [self.backward_rank(dp, v % self.pp, t) for t in range(self.tp)]

    def backward_inputs(self, rank: int) -> dict[int, list[tuple[int, int, int]]]:
        """What each forward rank sends backward rank `rank` in a step, in the sender's order:
        {sender: [(dp, microbatch, virtual stage), ...]} (microbatch-major, then virtual stage ascending)."""
        c = coord_of(rank, self.tp, self.pp, self.dp)
        out: dict[int, list[tuple[int, int, int]]] = {}
        for m in range(self.microbatches):
            k = self.instance_of(c.dp, m)
            for v in range(c.pp, self.virtual_stages, self.pp):
                if v > 0:
                    out.setdefault(self.input_sender(v, k, c.tp), []).append((c.dp, m, v))
        return out

    def forward_sends(self, rank: int) -> list[tuple[int, tuple[int, int, int]]]:
        """The stage inputs forward rank `rank` sends in a step, in issue order: [(backward rank, key), ...]."""
        k, stage, _ = self.forward_coord(rank)
        out = []
        for d, m in self.jobs(k):
            for v in self.forward_segments(stage):
                for t, dst in enumerate(self.input_receivers(v + 1, d)):
                    if self.input_sender(v + 1, k, t) == rank:
                        out.append((dst, (d, m, v + 1)))
        return out

    def weight_source_replica(self, instance: int) -> int:
        """The DP replica whose weights an instance receives (replicas are identical; spread the sending)."""
        return instance % self.dp


# -- weights: backward layout -> forward layout -------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """One parameter of virtual stage `v` as both layouts shard it.

    `dim` is the TP partition dimension (None: replicated over TP); `local_b`/`local_f` the shard extents along
    it at tp and tp_f; `real` how much of the extent is model (a padded vocabulary's real rows)."""

    name: str
    v: int
    dim: int | None
    local_b: int = 0
    local_f: int = 0
    real: int = 0


@dataclass(frozen=True)
class Transfer:
    """Copy `length` elements along `dim` from the source shard (from `src_start`) into the destination shard
    (from `dst_start`); with dim None the whole tensor."""

    name: str
    src: int  # global backward rank
    dst: int  # global forward rank
    dim: int | None
    src_start: int = 0
    dst_start: int = 0
    length: int = 0


def tp_overlaps(local_b: int, tp: int, local_f: int, tp_f: int, real: int) -> list[tuple[int, int, int, int, int]]:
    """(tp rank b, tp rank f, start in b's shard, start in f's shard, length) for every overlap of the real
    part [0, real) of a dimension split in `tp` shards of `local_b` and in `tp_f` shards of `local_f`.

    Padding (beyond `real`) is never moved: its size depends on tp, and it stays zero on both sides."""
    out = []
    for tb in range(tp):
        for tf in range(tp_f):
            lo = max(tb * local_b, tf * local_f)
            hi = min((tb + 1) * local_b, (tf + 1) * local_f, real)
            if hi > lo:
                out.append((tb, tf, lo - tb * local_b, lo - tf * local_f, hi - lo))
    return out


def weight_plan(layout: FbdLayout, specs: list[ParamSpec]) -> list[Transfer]:
    """Every copy that brings the forward instances up to date with the backward weights, in a fixed order
    (instance, parameter, shard) that both ends derive from the same arguments."""
    plan = []
    for k in range(layout.n_f):
        d = layout.weight_source_replica(k)
        for s in specs:
            stage_b, stage_f = s.v % layout.pp, layout.forward_stage_of(s.v)
            if s.dim is None:  # replicated over TP: forward TP rank t takes TP rank t's copy (tp_f <= tp)
                for tf in range(layout.tp_f):
                    plan.append(Transfer(s.name, layout.backward_rank(d, stage_b, tf % layout.tp),
                                         layout.forward_rank(k, stage_f, tf), None))
                continue
            for tb, tf, a, b, n in tp_overlaps(s.local_b, layout.tp, s.local_f, layout.tp_f, s.real):
                plan.append(Transfer(s.name, layout.backward_rank(d, stage_b, tb), layout.forward_rank(k, stage_f, tf),
                                     s.dim, a, b, n))
    return plan
