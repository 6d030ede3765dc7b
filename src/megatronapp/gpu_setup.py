"""What a GPU run sets around CUDA's start, decided once from the run config (issue 39, item 8).

- `launch_env(cfg, backend)`: variables CUDA reads when a process creates its context, so they must be in every
  rank's environment before it touches the GPU: `CUDA_DEVICE_MAX_CONNECTIONS=1` when TP collectives overlap GEMMs
  (sequence parallelism, `--tp-comm-overlap`). With one hardware work queue kernels start in launch order, so a
  collective launched before a GEMM gets its SMs first; with several (CUDA's default is 8) the GEMM can take them
  all and the "overlapped" collective waits for it. Megatron-LM requires the same for sequence parallelism. A value
  the user set is kept.
- `math_modes(device, tf32)`: TF32 for fp32 matmuls and convolutions on a GPU (`train.tf32`, on by default; PyTorch
  leaves matmuls in full fp32 since 1.12): fp32 runs use the tensor cores, as Megatron-LM's do. `--no-tf32` for
  runs compared number for number with the CPU.
- `check_semantics(cfg, backend)`: the strict comm semantics make gloo obey NCCL's rules; on NCCL itself they mean
  nothing, so they are refused whenever the backend resolves to NCCL, `--backend auto` on a GPU machine included.
"""
from __future__ import annotations

import os

import torch

from megatronapp.config import RunConfig
from megatronapp.errors import ConfigError


def launch_env(cfg: RunConfig, backend: str) -> dict[str, str]:
    """The environment every rank of this run needs before CUDA starts (empty off NCCL)."""
    p = cfg.parallel
    if backend != "nccl" or p.tp == 1 or not (p.sequence_parallel or p.tp_comm_overlap):
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}


def math_modes(device: torch.device, tf32: bool) -> None:
    """TF32 on or off for this process's fp32 matmuls and convolutions on a GPU (nothing to do on the CPU)."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def check_semantics(cfg: RunConfig, backend: str) -> None:
    """Refuse emulated NCCL rules on a run whose backend is NCCL itself."""
    mode = cfg.parallel.comm_semantics
    if mode != "native" and backend == "nccl":
        how = "--backend auto picks NCCL on this GPU machine" if cfg.parallel.backend == "auto" else "--backend nccl"
        raise ConfigError(f"parallel.comm_semantics={mode!r} emulates NCCL's rules on gloo, but {how}, where the "
                          f"rules hold natively: use --comm-semantics native (or --backend gloo to emulate them)")
