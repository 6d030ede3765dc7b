"""PyTorch-native peers of our engine, built to compute exactly what our engine computes.

Each peer trains the same model (same weights, batch, microbatches, loss, global-norm clipping, AdamW and
learning rate) with PyTorch's own parallelism:
  PipelinePeer  torch.distributed.pipelining stages (Schedule1F1B / ScheduleInterleaved1F1B) made of our own
                TransformerChunk layer ranges (no tensor parallelism), so the stage math is ours.
  TensorPeer    DTensor `parallelize_module` (ColwiseParallel / RowwiseParallel, loss_parallel) on a plain
                nn.Linear GPT written here, loaded with our one-process model's weights.
  DataPeer      DistributedDataParallel around our one-process `build_model`, no_sync on all but the last
                microbatch.
`step(k)` runs optimizer step k on the global batch of step k and returns the global mean loss.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatronapp.config import RunConfig
from megatronapp.data.dataset import BatchSource
from megatronapp.model.transformer import TransformerChunk, build_model
from megatronapp.partition import stage_chunks
from megatronapp.train.optim import build_optimizer, lr_at, set_lr


def _clip_(grads_local: list[torch.Tensor], grads_sharded: list[torch.Tensor], max_norm: float,
           group: dist.ProcessGroup, scale: list[torch.Tensor]) -> float:
    """Global-norm clipping as torchtitan does it: fused per-tensor norms (`get_total_norm`), the squares of
    `grads_sharded` (disjoint pieces) summed over `group`, `grads_local` counted once; returns the norm."""
    def sq(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        return torch.nn.utils.get_total_norm(grads, foreach=True).double() ** 2

    sq_shard = sq(grads_sharded)
    dist.all_reduce(sq_shard, group=group)
    norm = float((sq(grads_local) + sq_shard).sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(scale, coef)
    return norm


def _mean_loss(local_sum: float, count: int, group: dist.ProcessGroup | None = None) -> float:
    t = torch.tensor([local_sum, float(count)], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t[0] / t[1])


def _loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class PipelinePeer:
    """torch.distributed.pipelining over our chunks: stage v on rank v % pp (interleaved when vpp > 1)."""

    def __init__(self, cfg: RunConfig, rank: int, data: BatchSource):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        m, p, t = cfg.model, cfg.parallel, cfg.train
        self.cfg, self.data, self.rank = cfg, data, rank
        V = p.pp * p.vpp
        self.chunks: list[TransformerChunk] = []
        stages = []
        for c, (start, end) in enumerate(stage_chunks(m.num_layers, p.pp, p.vpp, rank)):
            v = c * p.pp + rank
            chunk = TransformerChunk(m, start, end, pre_process=v == 0, post_process=v == V - 1, seed=t.seed)
            self.chunks.append(chunk)
            stages.append(PipelineStage(chunk, v, V, torch.device("cpu")))
        self.has_first = any(ch.pre_process for ch in self.chunks)
        self.has_last = any(ch.post_process for ch in self.chunks)
        if p.vpp == 1:
            self.schedule = Schedule1F1B(stages[0], p.microbatches, loss_fn=_loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, p.microbatches, loss_fn=_loss_fn)
        self.params = [q for ch in self.chunks for q in ch.parameters()]
        self.optimizer = build_optimizer(self.params, t)

    def step(self, k: int) -> float:
        """One optimizer step over the global batch of step `k`; the global mean loss."""
        ids, labels = self.data.get(k)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (ids,) if self.has_first else ()
        target = labels if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None)
        grads = [q.grad for q in self.params if q.grad is not None]
        # Pipeline stages hold disjoint parameters: the squared norms add up over the pipeline.
        _clip_([], grads, self.cfg.train.grad_clip, dist.group.WORLD, grads)
        set_lr(self.optimizer, lr_at(k, self.cfg.train))
        self.optimizer.step()
        return _mean_loss(sum(float(x.detach()) for x in losses), len(losses))


class PlainBlock(nn.Module):
    """GPT-2 block on nn.Linear; qkv is fused in our per-head [q; k; v] order so a column split keeps heads whole."""

    def __init__(self, h: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.head_dim = h // heads
        self.norm1 = nn.LayerNorm(h, eps=eps)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(h, 3 * h), "proj": nn.Linear(h, h)})
        self.norm2 = nn.LayerNorm(h, eps=eps)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(h, ffn), "fc2": nn.Linear(ffn, h)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Under tensor parallelism the local qkv holds this rank's heads only: -1 is the local head count.
        qkv = self.attn["qkv"](self.norm1(x)).view(b, s, -1, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["proj"](a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """An untied GPT-2 whose state-dict names equal our TransformerChunk's, so our weights load as they are."""

    def __init__(self, cfg: RunConfig):
        super().__init__()
        m = cfg.model
        if m.family != "gpt2" or m.tie_embeddings or not m.bias or m.num_kv_heads != m.num_heads:
            raise ValueError("PlainGPT mirrors an untied GPT-2 with biases and no GQA (model.family=gpt2, "
                             "model.tie_embeddings=false)")
        self.embedding = nn.ModuleDict({"word": nn.Embedding(m.vocab_size, m.hidden_size),
                                        "position": nn.Embedding(m.max_seq_len, m.hidden_size)})
        self.layers = nn.ModuleDict({str(i): PlainBlock(m.hidden_size, m.num_heads, m.ffn_hidden_size, m.norm_eps)
                                     for i in range(m.num_layers)})
        self.final_norm = nn.LayerNorm(m.hidden_size, eps=m.norm_eps)
        self.output = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding["word"](ids) + self.embedding["position"].weight[: ids.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.final_norm(x))


def tp_plan(model: PlainGPT) -> dict:
    """torchtitan-style plan: vocab-parallel embedding and head, column- then row-parallel attention and MLP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"embedding.word": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in model.layers:
        plan.update({f"layers.{i}.attn.qkv": ColwiseParallel(), f"layers.{i}.attn.proj": RowwiseParallel(),
                     f"layers.{i}.mlp.fc1": ColwiseParallel(), f"layers.{i}.mlp.fc2": RowwiseParallel()})
    return plan


class TensorPeer:
    """DTensor tensor parallelism over all ranks (a 1-D CPU mesh), gradient accumulation over microbatches."""

    def __init__(self, cfg: RunConfig, rank: int, data: BatchSource):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        self.cfg, self.data = cfg, data
        model = PlainGPT(cfg)
        model.load_state_dict(build_model(cfg.model, seed=cfg.train.seed).state_dict())
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.model = parallelize_module(model, self.mesh, tp_plan(model))
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.params, cfg.train)

    def step(self, k: int) -> float:
        """One optimizer step over the global batch of step `k`; the global mean loss."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        ids, labels = self.data.get(k)
        m = self.cfg.parallel.microbatches
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(ids.chunk(m), labels.chunk(m)):
            with loss_parallel():
                loss = _loss_fn(self.model(x), y)
                (loss / m).backward()
            total += float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())
        sharded, local = [], []
        for q in self.params:
            g = q.grad
            if isinstance(g, DTensor):
                (sharded if any(isinstance(pl, Shard) for pl in g.placements) else local).append(g.to_local())
            elif g is not None:
                local.append(g)
        _clip_(local, sharded, self.cfg.train.grad_clip, self.mesh.get_group(), sharded + local)
        set_lr(self.optimizer, lr_at(k, self.cfg.train))
        self.optimizer.step()
        return total / m


class DataPeer:
    """DistributedDataParallel around the one-process model; each rank trains its DP rows of the batch."""

    def __init__(self, cfg: RunConfig, rank: int, data: BatchSource):
        from torch.nn.parallel import DistributedDataParallel

        self.cfg, self.data = cfg, data
        self.ddp = DistributedDataParallel(build_model(cfg.model, seed=cfg.train.seed),
                                           bucket_cap_mb=cfg.parallel.grad_bucket_mb)
        self.params = list(self.ddp.parameters())
        self.optimizer = build_optimizer(self.params, cfg.train)

    def step(self, k: int) -> float:
        """One optimizer step over the global batch of step `k`; the global mean loss."""
        ids, labels = self.data.get(k)
        m = self.cfg.parallel.microbatches
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, (x, y) in enumerate(zip(ids.chunk(m), labels.chunk(m))):
            if i < m - 1:
                with self.ddp.no_sync():  # accumulate locally; the last microbatch's backward all-reduces
                    loss = self.ddp(x, labels=y)
                    (loss / m).backward()
            else:
                loss = self.ddp(x, labels=y)
                (loss / m).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip or math.inf)
        set_lr(self.optimizer, lr_at(k, self.cfg.train))
        self.optimizer.step()
        return _mean_loss(total / m, 1)


PEERS = {"pipeline": PipelinePeer, "tensor": TensorPeer, "data": DataPeer}
