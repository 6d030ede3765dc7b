"""ZeRO-1, Megatron-LM's distributed optimizer (`--zero 1`): each DP rank keeps optimizer state for 1/dp of it.

Gradients live in the same flat fp32 bucket buffers as plain DP (`GradReducer`), issued in the same fixed order
(chunks last to first, buckets by index) whatever order a pipeline policy ran the backwards in; but a bucket is
*reduce-scattered* instead of all-reduced. Every bucket is padded to a multiple of dp, so DP rank r owns the
contiguous slice r of every bucket. It keeps AdamW or LAMB moments for that slice only, updates it, and the
updated parameters are all-gathered over DP into a flat parameter buffer per bucket that the parameters are views
of (Megatron's param buffer), so no unflatten copy. The engine's parameters are fp32 (bf16 runs compute under
autocast), so each parameter slice is its own fp32 master: no master copy is needed, and a parameter of another
dtype is refused (the gradient buffers, plain DP's too, bind fp32 gradients to the parameters).

Everything that needs the whole reduced gradient works on the owned slices instead:
- replicated gradients (tied embeddings across stages, sequence-parallel partials across TP) are summed over
  the owned slices: TP peers have identical bucket layouts, and a tied embedding gets a bucket of its own on the
  first and last stage, so the peers' slices hold the same elements. The sums are linear, so summing after the
  DP mean gives the plain run's numbers.
- the global gradient norm sums squares over the owned slices (counted as `grad_norm.py` counts: replicated
  TP parameters once, the tied copy once) and all-reduces over DP, then TP and PP.
- LAMB's trust ratio needs ||w|| and ||update|| of the whole parameter: partial squares per parameter are summed
  over DP (one collective for all parameters), then over TP for tensor-parallel shards, as `train/optim.py` does.
AdamW is torch's own, stepping views of the owned slices: its math is element-wise, so each element gets exactly
the plain run's update.

After a step only the owned slice of a gradient buffer holds the reduced gradient (`gather_grads()` fills the rest,
for tests). The all-gathers of a step are issued together and waited before the step ends; they are not carried
over into the next step's forward, because checkpoints, MegaScope and tests read the parameters between steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatronapp.config import TrainConfig
from megatronapp.eager_optim import AdamW, Eager
from megatronapp.parallel import comm
from megatronapp.parallel.data_parallel import GradReducer, _Bucket
from megatronapp.parallel.topology import Topology


@dataclass
class _Segment:
    """The part of one parameter that lies in this rank's slice of its bucket."""

    param: nn.Parameter
    index: int  # position in this rank's list of all parameters (the same on every DP and TP peer)
    chunk: int
    grad: torch.Tensor  # flat view into the bucket's gradient buffer
    data: torch.Tensor  # flat view into the bucket's parameter buffer
    shard: nn.Parameter  # what the optimizer steps: an alias of `data` (the parameter is its own fp32 master)


class _ShardedLAMB(Eager, torch.optim.Optimizer):
    """LAMB (as `train/optim.LAMB`) over parameter slices: whole-parameter norms come from partial sums over DP."""

    def __init__(self, groups: list[dict], owner: DistributedOptimizer, lr: float, betas: tuple[float, float],
                 eps: float):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.owner = owner

    @torch.no_grad()
    def step(self, closure=None):  # torch's signature
        o = self.owner
        entries = []
        # [n_params, 2] partial ||w||^2, ||update||^2 of every parameter of this rank (zeros where it owns none)
        sq = torch.zeros(len(o.all_params), 2, dtype=torch.float32, device=o.device)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for s in group["params"]:
                state = self.state[s]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(s)
                    state["exp_avg_sq"] = torch.zeros_like(s)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = s.grad.to(m.dtype)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(s.to(update.dtype), alpha=group["weight_decay"])
                i = o.shard_index[id(s)]
                entries.append((s, update, group["lr"], i))
                sq[i] = torch.stack([s.detach().float().pow(2).sum(), update.float().pow(2).sum()])
        comm.all_reduce(sq, o.dp_group)  # every DP peer, even one that owns nothing: the same collective order
        if o.tp_shard_mask.any() and o.topo.tp > 1:
            mask = o.tp_shard_mask.to(sq.device)
            sq = torch.where(mask[:, None], comm.all_reduce(sq * mask[:, None], o.topo.tp_group), sq)
        norms = sq.sqrt()
        w_norm, u_norm = norms[:, 0], norms[:, 1]
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm))
        for s, update, lr, i in entries:
            s.add_((update * trust[i]).to(s.dtype), alpha=-lr)


class DistributedOptimizer(GradReducer):
    """The executor's GradSync (reduce-scatter in buckets) and the optimizer (sharded state, all-gathered update)."""

    def __init__(self, chunks: list[nn.Module], topo: Topology, tcfg: TrainConfig, bucket_mb: float = 4.0,
                 overlap: bool = True):
        self.topo, self.chunks = topo, chunks
        for c in chunks:
            for name, p in c.named_parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    raise ValueError(f"parallel.zero=1 needs fp32 parameters (bf16 runs keep fp32 weights and compute "
                                     f"under autocast); {name} is {p.dtype}")
        self.dp, self.dp_rank = topo.dp_group.size, topo.dp_group.rank_in(topo.rank)
        self.device = next(p.device for c in chunks for p in c.parameters())
        super().__init__(chunks, topo.dp_group, bucket_mb, overlap)
        self.all_params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(self.all_params)}
        self.tp_shard_mask = torch.tensor([bool(getattr(p, "tensor_parallel", False)) for p in self.all_params])
        self.segments: list[_Segment] = []
        self.pbufs: dict[tuple[int, int], torch.Tensor] = {}
        for c, buckets in self.buckets.items():
            for bi, b in enumerate(buckets):
                self.pbufs[(c, bi)] = self._bind_params(b, c, index)
        self.shard_index = {id(s.shard): s.index for s in self.segments}
        decay = [s.shard for s in self.segments if s.param.dim() >= 2]
        no_decay = [s.shard for s in self.segments if s.param.dim() < 2]
        # Both groups always exist (possibly empty), so every rank's state_dict and set_lr see the same groups.
        groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        betas = (tcfg.beta1, tcfg.beta2)
        if tcfg.optimizer == "adamw":
            self.inner: torch.optim.Optimizer = AdamW(groups, lr=tcfg.lr, betas=betas, eps=tcfg.eps)
        elif tcfg.optimizer == "lamb":
            self.inner = _ShardedLAMB(groups, self, lr=tcfg.lr, betas=betas, eps=tcfg.eps)
        else:
            raise ValueError(f"train.optimizer={tcfg.optimizer!r}: choose adamw or lamb")
        self._counted = self._counted_segments()

    # -- layout -------------------------------------------------------------------------------------------
    def _solo(self, chunk: nn.Module) -> set[int]:
        """A tied embedding alone in its bucket, so the first and last stage slice it alike."""
        shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
        return set() if shared is None else {id(shared)}

    def _new_buffer(self, params: list[nn.Parameter]) -> torch.Tensor:
        n = sum(p.numel() for p in params)
        padded = -(-n // self.dp) * self.dp  # every DP rank owns an equal contiguous slice
        return torch.zeros(padded, dtype=torch.float32, device=params[0].device)

    def _owned(self, b: _Bucket) -> tuple[int, int]:
        size = b.buffer.numel() // self.dp
        return self.dp_rank * size, (self.dp_rank + 1) * size

    def _bind_params(self, b: _Bucket, chunk: int, index: dict[int, int]) -> torch.Tensor:
        """Move the bucket's parameters into one flat buffer (they become views of it); record owned segments."""
        pbuf = torch.zeros_like(b.buffer)  # fp32, like the parameters
        lo, hi = self._owned(b)
        offset = 0
        for p in b.params:
            n = p.numel()
            pbuf[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = pbuf[offset:offset + n].view_as(p)
            a, z = max(lo, offset), min(hi, offset + n)
            if a < z:
                data = pbuf[a:z]
                shard = nn.Parameter(data)  # shares the storage: the update lands in the parameter
                shard.grad = b.buffer[a:z]
                self.segments.append(_Segment(p, index[id(p)], chunk, b.buffer[a:z], data, shard))
            offset += n
        return pbuf

    def _counted_segments(self) -> list[_Segment]:
        """Segments whose gradient enters the global norm (as `grad_norm.py` counts parameters)."""
        pp, coord = self.topo.pp, self.topo.coord
        out = []
        for s in self.segments:
            chunk = self.chunks[s.chunk]
            shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
            if shared is not None and s.param is shared and s.chunk * pp + coord.pp != 0:
                continue  # the last stage's copy of a tied embedding: counted on the first stage
            if not getattr(s.param, "tensor_parallel", False) and coord.tp != 0:
                continue
            out.append(s)
        return out

    # -- GradSync -----------------------------------------------------------------------------------------
    def _start(self, b: _Bucket, chunk: int, bi: int) -> comm.Handle:
        return comm.reduce_scatter_inplace_async(b.buffer, self.dp_group, label=f"grad chunk {chunk} bucket {bi}")

    def _average(self, b: _Bucket, inv: float) -> None:
        lo, hi = self._owned(b)
        b.buffer[lo:hi].mul_(inv)

    # -- the step's tail on owned slices -----------------------------------------------------------------
    def sync_replicated_grads(self, sequence_parallel: bool) -> None:
        """Sum the owned slices of replicated gradients: tied embeddings across stages, SP partials across TP."""
        topo = self.topo
        for c, chunk in enumerate(self.chunks):
            shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
            if shared is not None and topo.embedding_group.size > 1:
                for s in self.segments:
                    if s.param is shared:  # its peer owns the same elements (same bucket layout)
                        comm.all_reduce(s.grad, topo.embedding_group)
            if sequence_parallel and topo.tp > 1:
                grads = [s.grad for s in self.segments
                         if s.chunk == c and getattr(s.param, "sequence_parallel", False)]
                if grads:  # TP peers have the same layout, so all or none of them get here
                    flat = comm.all_reduce(torch.cat(grads), topo.tp_group)
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset:offset + g.numel()])
                        offset += g.numel()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm from the owned slices (identical on every rank); clip to `max_norm` (0: don't)."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        grads = [s.grad for s in self._counted]
        if grads:
            sq += torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).double() ** 2
        comm.all_reduce(sq, self.dp_group)
        comm.all_reduce(sq, self.topo.tp_group)
        comm.all_reduce(sq, self.topo.pp_group)
        norm = float(sq.sqrt())  # the step's one host read of it: the metrics and the clip decision
        if max_norm > 0 and max_norm / (norm + 1e-6) < 1.0:
            # torch's clip_grads_with_norm_ arithmetic, on the owned slices only; the norm in fp32 as
            # torch.tensor(norm) would hold it, but on the device (no host-to-device copy)
            coef = (max_norm / (sq.sqrt().to(torch.float32).reshape(()) + 1e-6)).clamp(max=1.0)
            grads = [s.grad for s in self.segments]
            if grads:
                torch._foreach_mul_(grads, coef)
        return norm

    # -- torch.optim.Optimizer's surface used by the trainer -----------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """Update the owned slices, then all-gather every bucket's parameters over DP (issued together)."""
        self.inner.step()
        handles = [comm.all_gather_inplace_async(self.pbufs[(c, bi)], self.dp_group, label=f"param chunk {c} "
                                                 f"bucket {bi}") for c, bi in self._order]
        for h in handles:
            h.wait()

    def gather_grads(self) -> None:
        """Fill every gradient buffer with the reduced gradient from the owners (for checks, not training)."""
        handles = [comm.all_gather_inplace_async(self.buckets[c][bi].buffer, self.dp_group, label=f"grad chunk "
                                                 f"{c} bucket {bi}") for c, bi in self._order]
        for h in handles:
            h.wait()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: moments and step counters (no master copies: see above)."""
        return _state_tensor_bytes(self.inner)

    def _layout(self) -> list[list[int]]:
        return [[s.index, s.shard.numel()] for s in self.segments]

    def slice_state(self) -> dict:
        """This DP rank's own part of the optimizer state (what no DP peer holds): its slice's moments and step
        counters, tagged with the slicing. The parameters are replicated over DP after each step (all-gathered),
        so this is all a DP peer lacks to stand in for this rank (in-place recovery's buddy copy)."""
        return self.state_dict()

    def slice_bytes_bound(self) -> int:
        """At most the tensor bytes of any DP rank's `slice_state()`: two fp32 moments of its slice (every DP rank's
        slice of a bucket has the same size) and a few bytes of step counter per parameter it may touch."""
        slice_numel = sum(b.buffer.numel() // self.dp for buckets in self.buckets.values() for b in buckets)
        return 2 * 4 * slice_numel + 64 * len(self.all_params)

    def state_dict(self) -> dict:
        return {"zero": 1, "dp": self.dp, "dp_rank": self.dp_rank, "layout": self._layout(),
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("zero") != 1 or state.get("dp") != self.dp or state.get("layout") != self._layout():
            raise ValueError(f"the optimizer state was saved with zero={state.get('zero', 0)}, dp={state.get('dp')} "
                             f"and another slicing of the buckets; this run has zero=1, dp={self.dp}: resume with "
                             f"the same parallel.zero, dp and parallel.grad_bucket_mb")
        if state.get("dp_rank", self.dp_rank) != self.dp_rank:
            raise ValueError(f"the optimizer state is DP rank {state.get('dp_rank')}'s slice; this is DP rank "
                             f"{self.dp_rank}")
        self.inner.load_state_dict(state["inner"])


def _state_tensor_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes this rank holds for optimizer state (moments, step counters), for either optimizer."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.state_bytes()
    return _state_tensor_bytes(optimizer)
