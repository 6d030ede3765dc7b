"""Weight freshness: after every optimizer step the backward weights move to the forward layout.

The plan (`layout.weight_plan`) is derived from parameter shapes alone, which both sides compute by building
the chunks on the "meta" device (shapes, no storage). Each (backward rank, forward rank) pair then exchanges one
flat message per hand-off: the sender packs its slices in plan order, the receiver unpacks them in the same
order. Each pair's message travels on its own `fbd.weights` link (a 2-rank group carrying backward -> forward
traffic only).
"""
from __future__ import annotations

import torch
from torch import nn

from megatronapp.config import ModelConfig
from megatronapp.fbd.groups import PairLinks
from megatronapp.fbd.layout import FbdLayout, ParamSpec, Transfer, weight_plan
from megatronapp.model.transformer import TransformerChunk
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group
from megatronapp.partition import split_layers


def segment(cfg: ModelConfig, layout: FbdLayout, v: int, tp_group: Group | None, device, seed: int,
            sequence_parallel: bool) -> TransformerChunk:
    """The layers of virtual stage v as the forward side holds them: embedding on v = 0, never the head."""
    start, end = split_layers(cfg.num_layers, layout.pp, layout.vpp)[v]
    return TransformerChunk(cfg, start, end, pre_process=v == 0, post_process=False, tp_group=tp_group,
                            sequence_parallel=sequence_parallel, seed=seed, device=device)


def param_specs(cfg: ModelConfig, layout: FbdLayout) -> list[ParamSpec]:
    """How each parameter the forward side needs is sharded at tp (backward) and tp_f (forward).

    Shapes come from a one-process build on the meta device: a TP-sharded dimension of extent E splits into
    E / tp shards, except a vocabulary, which is first padded to `padded_vocab_size(tp)` (only its first
    `vocab_size` rows are model)."""
    specs = []
    for v in range(layout.virtual_stages - 1):
        for name, p in segment(cfg, layout, v, None, "meta", 0, False).named_parameters():
            if not getattr(p, "tensor_parallel", False):
                specs.append(ParamSpec(name, v, None))
                continue
            dim, vocab = p.partition_dim, getattr(p, "vocab_size", None)
            if vocab is not None:
                specs.append(ParamSpec(name, v, dim, cfg.padded_vocab_size(layout.tp) // layout.tp,
                                       cfg.padded_vocab_size(layout.tp_f) // layout.tp_f, vocab))
            else:
                full = p.shape[dim]
                specs.append(ParamSpec(name, v, dim, full // layout.tp, full // layout.tp_f, full))
    return specs


def _piece(t: torch.Tensor, tr: Transfer, src_side: bool) -> torch.Tensor:
    if tr.dim is None:
        return t
    return t.narrow(tr.dim, tr.src_start if src_side else tr.dst_start, tr.length)


class WeightLink:
    """One rank's share of the hand-off: what it sends (backward) or receives (forward), grouped by peer."""

    def __init__(self, layout: FbdLayout, specs: list[ParamSpec], rank: int, params: dict[str, nn.Parameter],
                 links: PairLinks):
        self.params, self.links, self.rank = params, links, rank
        plan = weight_plan(layout, specs)
        self.outgoing: dict[int, list[Transfer]] = {}
        self.incoming: dict[int, list[Transfer]] = {}
        for tr in plan:
            if tr.src == rank:
                self.outgoing.setdefault(tr.dst, []).append(tr)
            if tr.dst == rank:
                self.incoming.setdefault(tr.src, []).append(tr)
        missing = {tr.name for trs in (*self.outgoing.values(), *self.incoming.values()) for tr in trs} - set(params)
        if missing:
            raise RuntimeError(f"rank {rank}: the weight plan names parameters this rank does not hold: "
                               f"{sorted(missing)[:5]}")
        self._sends: list[comm.Handle] = []

    def send(self) -> None:
        """Start sending this backward rank's slices (asynchronous; finished by `finish_sends`)."""
        self.finish_sends()
        with torch.no_grad():
            for dst in sorted(self.outgoing):
                flat = torch.cat([_piece(self.params[tr.name], tr, True).reshape(-1)
                                  for tr in self.outgoing[dst]]).float()
                self._sends.append(comm.isend(flat, dst, self.links(dst)))

    def finish_sends(self) -> None:
        while self._sends:
            self._sends.pop(0).wait()

    def receive(self) -> float:
        """Receive every slice this forward rank needs and write it in place; return the largest change (0.0
        when the forward weights were already equal, as at step 0)."""
        changed = 0.0
        handles = []
        for src in sorted(self.incoming):
            n = sum(_piece(self.params[tr.name], tr, False).numel() for tr in self.incoming[src])
            buf = torch.empty(n, dtype=torch.float32, device=next(iter(self.params.values())).device)
            handles.append((src, buf, comm.irecv(buf, src, self.links(src))))
        with torch.no_grad():
            for src, buf, h in handles:
                h.wait()
                offset = 0
                for tr in self.incoming[src]:
                    dst = _piece(self.params[tr.name], tr, False)
                    new = buf[offset:offset + dst.numel()].view(dst.shape).to(dst.dtype)
                    offset += dst.numel()
                    changed = max(changed, float((dst - new).abs().max()) if dst.numel() else 0.0)
                    dst.copy_(new)
        return changed
