"""Feed-forward blocks: GPT-2's GELU MLP and Llama's SwiGLU, both column- then row-parallel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatronapp.config import ModelConfig
from megatronapp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, column_parallel_linear
from megatronapp.parallel.topology import Group


class MLP(nn.Module):
    """gpt2: fc2(gelu_tanh(fc1 x)); llama: down(silu(gate x) * up x). The hidden [.., f/tp] stays sharded."""

    def __init__(self, cfg: ModelConfig, tp_group: Group | None = None, sequence_parallel: bool = False,
                 tp_comm_overlap: int = 0):
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.ffn_hidden_size, bool(cfg.bias)
        self.swiglu = cfg.family == "llama"
        tp = {"tp_group": tp_group, "sequence_parallel": sequence_parallel, "tp_comm_overlap": tp_comm_overlap}
        if self.swiglu:
            # Gate and up stay two parameters (names, TP shards, initialisation and checkpoints of the unfused
            # model) but run fused: one input collective and one GEMM over this rank's [gate shard; up shard],
            # a contiguous stack that holds whole hidden units of each (column_parallel_linear).
            self.gate = ColumnParallelLinear(h, f, bias=bias, **tp)
            self.up = ColumnParallelLinear(h, f, bias=bias, **tp)
            self.down = RowParallelLinear(f, h, bias=bias, **tp)
        else:
            self.fc1 = ColumnParallelLinear(h, f, bias=bias, **tp)
            self.fc2 = RowParallelLinear(f, h, bias=bias, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = column_parallel_linear(x, (self.gate, self.up)).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
