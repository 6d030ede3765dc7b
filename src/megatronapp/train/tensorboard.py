"""TensorBoard event files of the training metrics (`--tensorboard DIR`), written by the lead rank.

The same numbers as metrics.jsonl, under the tag names Megatron-LM and torchtitan use, so existing
dashboards read them. `tensorboard` is imported only when a writer is made: runs without the flag pay nothing
at start-up.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# metrics.jsonl key -> TensorBoard tag
TAGS: dict[str, str] = {
    "loss": "loss",
    "val_loss": "validation/loss",  # only on the steps that evaluated (--eval-interval)
    "lr": "lr",
    "grad_norm": "grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "mfu",
    "mem_bytes": "memory/peak_bytes",
    "step_time": "time/step_s",
    "data_s": "time/data_s",
    "wait_s": "time/wait_s",
}


class TensorBoardLog:
    """Scalars of each step's metrics record, at x = the record's step.

    `resumed_at`: the step a resumed run starts from. Steps after it that an earlier attempt already logged
    into the same directory (a run restarted after a failure replays them) are purged for TensorBoard's readers
    (torch's `purge_step`), so each step shows one value, the replayed one, which is what the run kept."""

    def __init__(self, logdir: str | Path, resumed_at: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the `tensorboard` package
            raise RuntimeError(f"--tensorboard needs the 'tensorboard' package ({e}); pip install tensorboard"
                               ) from None
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._w = SummaryWriter(log_dir=str(self.logdir), purge_step=resumed_at + 1 if resumed_at > 0 else None)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, tag in TAGS.items():
            v = record.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._w.add_scalar(tag, float(v), step)
        self._w.flush()  # as metrics.jsonl: a crashed run keeps every logged step

    def close(self) -> None:
        self._w.close()
