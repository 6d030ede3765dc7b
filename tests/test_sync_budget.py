"""The sync budget, as far as a CPU can hold it (issue 39): a training step reads device values on the host a fixed
number of times, whatever its microbatch count, and clipping adds none.

On a GPU each such read (`.item()`, `.tolist()`, `float(t)`, ...) waits for every kernel queued before it. The
engine takes the same code path on the CPU (the microbatch losses stay tensors until `global_loss`), so counting the
reads the engine's own code makes during a CPU step counts the GPU's. The batch is built in host memory (data/),
where a read touches no device, and torch's own internals are not counted; `benchmarks/gpu_check.py` measures the
whole budget on a GPU with `torch.cuda.set_sync_debug_mode`. The budget per step, for a single stage:
    1. the global gradient norm (metrics, and whether to clip)
    2. the global loss (metrics)
A pipeline stage with a static schedule adds one: its headers, checked once per step (pipeline/p2p.py).
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

from megatronapp.config import RunConfig
from megatronapp.train.trainer import Trainer

HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
SRC = str(Path(__file__).resolve().parents[1] / "src" / "megatronapp")
HOST_DATA = (f"{SRC}/data/",)  # batches are made in host memory


class HostReads:
    """Counts host reads of tensor values made by the engine's own code (by the calling frame's file)."""

    def __init__(self) -> None:
        self.where: collections.Counter = collections.Counter()
        self._saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def __enter__(self) -> HostReads:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def read(t, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(SRC) and not caller.startswith(HOST_DATA):
                self.where[(name, caller.removeprefix(SRC + "/"), sys._getframe(1).f_lineno)] += 1
            return fn(t, *a, **k)
        return read

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)

    @property
    def total(self) -> int:
        return sum(self.where.values())


def _trainer(tmp_path, microbatches: int, grad_clip: float) -> Trainer:
    cfg = RunConfig.from_dict({
        "model": {"family": "llama", "vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "num_kv_heads": 1, "max_seq_len": 32},
        "parallel": {"microbatches": microbatches},
        "train": {"steps": 3, "global_batch_size": microbatches, "seq_len": 16, "out": str(tmp_path),
                  "data_prefetch": 0, "grad_clip": grad_clip}})
    return Trainer(cfg, 0)


@pytest.mark.parametrize("grad_clip", [1.0, 1e-6], ids=["clip-off", "clip-on"])
def test_a_step_reads_device_values_twice_whatever_its_microbatches(tmp_path, grad_clip):
    counts = {}
    for m in (2, 6):
        tr = _trainer(tmp_path / str(m), m, grad_clip)
        tr.train_step()  # warm-up
        with HostReads() as reads:
            tr.train_step()
        counts[m] = reads
    assert counts[2].total == counts[6].total == 2, {m: dict(r.where) for m, r in counts.items()}
    assert {(n, f) for n, f, _ in counts[6].where} == {("__float__", "parallel/grad_norm.py"),
                                                      ("__float__", "train/trainer.py")}
