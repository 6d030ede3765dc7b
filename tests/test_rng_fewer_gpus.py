"""A checkpoint saved where a rank saw 8 GPUs resumes where it sees 2 (issue 39, item 7): each rank saves and
restores its own GPU's RNG state; `set_rng_state_all` with more states than visible GPUs raises (torch.cuda.random:
one `set_rng_state(state, i)` per saved state). Fake GPUs stand in for torch.cuda's RNG calls."""
from __future__ import annotations

import pytest
import torch

from megatronapp.train import checkpoint as ckpt


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> dict[int, torch.Tensor]:
    states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}

    def get(device="cuda") -> torch.Tensor:
        i = current if device == "cuda" else (device.index if isinstance(device, torch.device) else int(device))
        if i >= count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {i}")
        return states[i].clone()

    def put(state: torch.Tensor, device="cuda") -> None:
        i = current if device == "cuda" else (device.index if isinstance(device, torch.device) else int(device))
        if i >= count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {i}")
        states[i] = state.clone()

    for mod in (torch.cuda, torch.cuda.random):
        monkeypatch.setattr(mod, "get_rng_state", get)
        monkeypatch.setattr(mod, "set_rng_state", put)
        monkeypatch.setattr(mod, "device_count", lambda: count)
        monkeypatch.setattr(mod, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return states


def test_a_rank_resumes_with_fewer_visible_gpus(monkeypatch, tmp_path):
    _fake_gpus(monkeypatch, count=8, current=5)  # rank 5 of an 8-GPU node
    path = tmp_path / "rng.pt"
    torch.save(ckpt.rng_state(), path)
    with monkeypatch.context() as m:
        states = _fake_gpus(m, count=2, current=1)  # the same rank resumed on a 2-GPU machine
        ckpt.set_rng_state(torch.load(path, weights_only=True))
        assert states[1].tolist() == [5]  # this rank's own stream continues, on its new GPU
        assert states[0].tolist() == [0]  # another rank's GPU is not touched


def test_older_checkpoints_with_every_gpu_state_still_load(monkeypatch):
    _fake_gpus(monkeypatch, count=8, current=0)
    old = ckpt.rng_state()
    old["cuda"] = torch.cuda.get_rng_state_all()  # the format before: every visible GPU's state
    states = _fake_gpus(monkeypatch, count=2, current=0)
    ckpt.set_rng_state(old)
    assert [states[i].tolist() for i in range(2)] == [[0], [1]]
