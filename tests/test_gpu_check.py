"""benchmarks/gpu_check.sh: it fails (never skips) when a GPU is present that torch cannot use, skips each check with
its reason on a machine without a GPU, and its quick CPU rehearsal passes: the same script, launch paths (a single
rank; four ranks under torchrun with the per-rank NCCL wrapper, against the local launcher), plug-ins, trace
reading and WebSocket conversation, with gloo for NCCL. The first GPU run then tests the hardware, not the script.
Also: the multi-GPU plan is a set of valid configurations, and `scope serve --device cuda` is refused without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmarks import gpu_check, gpu_check_ranks

from megatronapp.cli import build_parser, config_from_args, main
from megatronapp.config import validate
from megatronapp.train.plugins import Hooks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


def _script(tmp_path: Path, *args: str, path: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "OUT"))
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "run"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _statuses(tmp_path: Path) -> dict[str, str]:
    data = json.loads((tmp_path / "OUT" / "gpu_check.json").read_text())
    return {r["check"]: r["status"] for r in data["results"]}


@no_gpu
def test_a_gpu_that_torch_cannot_use_fails_the_check(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)
    proc = _script(tmp_path, path=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "FAIL env" in proc.stdout and "has no CUDA" in proc.stdout and "NVIDIA H100" in proc.stdout
    assert "SKIP" not in proc.stdout and "skipped" not in proc.stdout
    assert _statuses(tmp_path) == {"env": "FAIL"}


@no_gpu
def test_without_a_gpu_every_check_says_why_it_skips(tmp_path):
    proc = _script(tmp_path, path=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                   if not (Path(p) / "nvidia-smi").exists()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses = _statuses(tmp_path)
    assert statuses.pop("env") == "PASS" and set(statuses.values()) == {"SKIP"}
    assert proc.stdout.count("no GPU on this machine") == len(gpu_check.CHECKS) - 1


def test_record_device_plugin(tmp_path):
    layer = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(rank=0, out=str(tmp_path), chunks=[layer], device=torch.device("cpu"),
                              autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    gpu_check.record_device(trainer)
    info = json.loads((tmp_path / gpu_check.DEVICE_FILE).read_text())
    assert info == {"device": "cpu", "param_devices": ["cpu"], "autocast": "torch.bfloat16"}
    trainer.rank = 1  # only rank 0 writes
    (tmp_path / gpu_check.DEVICE_FILE).unlink()
    gpu_check.record_device(trainer)
    assert not (tmp_path / gpu_check.DEVICE_FILE).exists()


def test_count_syncs_plugin_counts_each_step_synchronisations(tmp_path, monkeypatch):
    """The plug-in turns torch's sync debug mode on for each step and counts its warnings (here raised by hand:
    on a GPU `set_sync_debug_mode("warn")` makes torch warn at each synchronising CUDA call)."""
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    trainer = SimpleNamespace(rank=0, out=str(tmp_path), device=torch.device("cuda", 0), hooks=Hooks())
    gpu_check.count_syncs(trainer)
    for step, syncs in ((1, 3), (2, 1)):
        trainer.hooks.fire("step_start", step - 1)
        for _ in range(syncs):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        trainer.hooks.fire("step_end", step, {"loss": 1.0})
    counted = json.loads((tmp_path / gpu_check.SYNC_FILE).read_text())
    assert {k: v["syncs"] for k, v in counted.items()} == {"1": 3, "2": 1}
    assert modes == ["warn", "default", "warn", "default"]


def test_the_multi_rank_plans_are_valid_configurations():
    """The 8-GPU set cannot run here; each of its configurations (and the one-GPU set) must at least validate."""
    for plans in (gpu_check_ranks.ONE_GPU, gpu_check_ranks.EIGHT_GPUS):
        for name, (nproc, flags) in plans.items():
            cfg = config_from_args(build_parser().parse_args(["train", *gpu_check_ranks.MODEL, *flags]))
            validate(cfg, nproc)
            assert cfg.parallel.total_ranks == nproc, name
            assert cfg.train.tf32 is False  # compared number for number with the CPU


@pytest.mark.slow
def test_quick_rehearsal_passes_on_cpu(tmp_path):
    proc = _script(tmp_path, "--rehearse-on-cpu", "--quick", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses = _statuses(tmp_path)
    assert statuses == {"env": "PASS", "train": "PASS", "resume": "PASS", "sync": "SKIP", "scan": "PASS",
                        "scope": "PASS", "ranks": "PASS"}, proc.stdout
    assert "gloo under torchrun vs gloo on the CPU" in proc.stdout  # the multi-rank path, launched as on a GPU


@no_gpu
def test_scope_serve_device_cuda_refused_without_a_gpu(capsys):
    assert main(["scope", "serve", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["scope", "serve", "--device", "cuda", "--tp", "2", "--nproc", "2"]) == 2
    assert "--device cpu" in capsys.readouterr().err
