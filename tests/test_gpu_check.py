"""benchmarks/gpu_check: skips cleanly without a GPU, and its checks pass when rehearsed on the CPU (the same
commands, plug-in, trace reading and WebSocket conversation, with CPU expectations), so the first GPU run tests
the hardware paths rather than the script. Also: `scope serve --device cuda` is refused clearly without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmarks import gpu_check

from megatronapp.cli import main

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@no_gpu
def test_script_skips_without_a_gpu():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU: skipped" in proc.stdout
    assert "PASS" not in proc.stdout and "FAIL" not in proc.stdout


@no_gpu
def test_scope_serve_device_cuda_refused_without_a_gpu(capsys):
    assert main(["scope", "serve", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["scope", "serve", "--device", "cuda", "--tp", "2", "--nproc", "2"]) == 2
    assert "--device cpu" in capsys.readouterr().err


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


@pytest.mark.slow
def test_checks_pass_rehearsed_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--rehearse-on-cpu", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS ") == len(gpu_check.CHECKS), proc.stdout
    assert f"{len(gpu_check.CHECKS)}/{len(gpu_check.CHECKS)} passed" in proc.stdout
