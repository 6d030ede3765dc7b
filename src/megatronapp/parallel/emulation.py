"""The one seam between a run and `--emulate-device` (the device model itself: `parallel/device_emulation.py`).

Who touches it, once each:
  * the role that runs a rank's steps (the engine's `Trainer`, a MegaFBD rank) creates an `Emulation` when it
    is built, calls `begin_step` at the start of each step and `close` at its end;
  * compute sites (the pipeline executor's tasks, MegaFBD's segments, the optimizer step) wrap their compute in
    `task(...)`, `segment(...)` or `optimizer_task()`, which find the process's active device without being
    handed it and do nothing when emulation is off;
  * the run loop (`train/loop.py`) asks `summary(...)` for summary.json's `emulation` entry.

`begin_step` makes this rank's device the active one: benchmarks that run several trainers in one process take
turns by step, and each step's tasks are costed on its own trainer's device. Fault drills (`faults.py`) find the
device a `slow-compute` drill slows through `active()`.
"""
from __future__ import annotations

from typing import Any

import torch

from megatronapp.config import RunConfig
from megatronapp.device_spec import parse_spec
from megatronapp.parallel import comm
from megatronapp.parallel.device_emulation import FIELDS, KINDS, EmulatedDevice, summarize
from megatronapp.parallel.topology import Group

_active: EmulatedDevice | None = None


class _NullTask:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _NullTask()


def active() -> EmulatedDevice | None:
    """This process's active emulated device, or None when emulation is off."""
    return _active


def _activate(device: EmulatedDevice | None) -> None:
    global _active
    _active = device


def task(kind: str, chunk: int, microbatch: int) -> Any:
    """Context of one pipeline task's compute ("F", "B", "W", or "BW": an unsplit backward) on the active
    device: on exit the rank sleeps until the task's modelled device time has passed. A no-op when off."""
    return _active.task(kind, chunk, microbatch) if _active is not None else _NULL


def segment(kind: str, v: int, microbatch: int) -> Any:
    """MegaFBD: context of virtual stage `v`'s "F", "R" or "BW" of one microbatch on the active device."""
    return _active.segment(kind, v, microbatch) if _active is not None else _NULL


def optimizer_task() -> Any:
    """Context of the optimizer step on the active device, or a no-op."""
    return _active.optimizer() if _active is not None else _NULL


class Emulation:
    """A rank's device emulation for one run (or nothing, when `cfg.emulate_device` is unset)."""

    def __init__(self, cfg: RunConfig, rank: int, dp: int, stage: int, local_params: int):
        self.spec = cfg.emulate_device
        self.device = (EmulatedDevice(parse_spec(self.spec), cfg, rank, dp, stage, local_params)
                       if self.spec else None)
        _activate(self.device)  # also: a device a previous run of this process left active is gone

    def begin_step(self, step: int) -> None:
        """Make this rank's device the active one and tell it the optimizer step (the jitter draws depend on it)."""
        _activate(self.device)
        if self.device is not None:
            self.device.begin_step(step)

    def record(self) -> list[list[float]] | None:
        """This rank's [kind][field] host-vs-device totals (`EmulatedDevice.record`), or None when off."""
        return self.device.record() if self.device is not None else None

    def summary(self, group: Group, rank: int, world: int, device: torch.device) -> dict[str, Any] | None:
        """summary.json's `emulation` entry: every rank's record summed into one table, by a collective over
        `group` (all `world` ranks, each calling this); None when emulation is off."""
        if not self.spec:
            return None
        rows = torch.zeros((world, len(KINDS), len(FIELDS)), dtype=torch.float64, device=device)
        if self.device is not None:
            rows[rank] = torch.tensor(self.device.record(), dtype=torch.float64)
        comm.all_reduce(rows, group)
        return summarize(self.spec, rows.tolist())

    def close(self) -> None:
        """Leave no active device behind (normal end or failure)."""
        if _active is self.device:
            _activate(None)
