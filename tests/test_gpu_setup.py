"""What a GPU run sets around CUDA's start (issue 39, item 8): one hardware queue when TP collectives overlap GEMMs,
TF32 for fp32 matmuls on a GPU (a flag turns it off), emulated NCCL rules refused when the backend resolves to NCCL,
`auto` on a GPU machine included."""
from __future__ import annotations

import os

import pytest
import torch

from megatronapp import gpu_setup, launch
from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import RunConfig
from megatronapp.errors import ConfigError
from megatronapp.train.trainer import prepare_gpu_launch


def _cfg(**parallel) -> RunConfig:
    return RunConfig.from_dict({"parallel": parallel})


def test_tp_overlap_on_nccl_gets_one_hardware_queue(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    sp = _cfg(tp=2, sequence_parallel=True)
    assert gpu_setup.launch_env(sp, "nccl") == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert gpu_setup.launch_env(_cfg(tp=2, sequence_parallel=True, tp_comm_overlap=True), "nccl")
    assert gpu_setup.launch_env(sp, "gloo") == {}  # no GPU, nothing to order
    assert gpu_setup.launch_env(_cfg(tp=2), "nccl") == {}  # no overlapped TP collective
    monkeypatch.setattr(launch, "pick_backend", lambda requested="auto": "nccl")
    prepare_gpu_launch(sp)  # before any rank starts: spawned ranks and torchrun's own rank inherit it
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")  # the user's choice stays
    assert gpu_setup.launch_env(sp, "nccl") == {"CUDA_DEVICE_MAX_CONNECTIONS": "4"}


def test_emulated_nccl_rules_are_refused_when_auto_picks_nccl(monkeypatch):
    cfg = _cfg(comm_semantics="nccl-eager")  # backend auto
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    with pytest.raises(ConfigError, match="--backend auto picks NCCL"):
        prepare_gpu_launch(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prepare_gpu_launch(cfg)  # on a CPU machine auto is gloo: the emulation is what it is for
    with pytest.raises(ConfigError, match="--backend nccl"):
        gpu_setup.check_semantics(_cfg(comm_semantics="nccl", backend="nccl"), "nccl")


def test_fp32_matmuls_use_tf32_on_a_gpu_unless_told_not_to():
    assert RunConfig().train.tf32 is True
    off = config_from_args(build_parser().parse_args(["train", "--no-tf32"]))
    assert off.train.tf32 is False
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        gpu_setup.math_modes(torch.device("cpu"), True)
        assert torch.backends.cuda.matmul.allow_tf32 is False  # the CPU has no TF32: untouched
        gpu_setup.math_modes(torch.device("cuda", 0), True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        gpu_setup.math_modes(torch.device("cuda", 0), False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
