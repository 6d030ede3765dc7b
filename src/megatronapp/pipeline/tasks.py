"""Pipeline tasks and the policy interface shared by the real executor and the simulator.

A stage (one pipeline rank) owns `vpp` model chunks. Chunk c of stage s is virtual stage v = c*pp + s
(Megatron's interleaving), so a microbatch visits stages 0..pp-1 with chunk 0, then again with chunk 1, ...
Task F(c, m) is ready when its input activation has arrived (or v == 0); B(c, m) is ready when F(c, m) is done
and the output gradient has arrived (or v is the last virtual stage). Schedules with a split backward
(`policy.split_backward`, zero-bubble) also run W(c, m), the weight gradient of B(c, m), ready once B(c, m) is
done; nobody waits for it. With a split backward a stage holds a microbatch's memory from F until W.

A policy sees only the tasks that are ready *now* and the stage's counters, and picks one, or None to wait
for more to become ready. Static schedules (GPipe, 1F1B, interleaved 1F1B) walk a fixed order and wait for its
next task; dynamic ones (MegaDPP) choose among the ready. The same policy objects drive the executor and the
discrete-event simulator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass(frozen=True, order=True)
class Task:
    kind: Literal["F", "B", "W"]
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


@dataclass
class StageView:
    """What a policy may look at: the stage's shape and its live counters (kept by the executor/simulator)."""

    stage: int  # pipeline rank
    pp: int
    vpp: int
    microbatches: int
    max_inflight: int | None = None  # cap on activations held for backward (chunk-microbatches)
    done: set[Task] = field(default_factory=set)
    # forward done, backward not yet done (chunk-microbatch activations held); with a split backward, until W
    inflight: int = 0
    peak_inflight: int = 0
    split: bool = False  # the backward is split into B and W tasks
    pending_w: int = 0  # B done, W not yet done
    pending_w_bytes: int = 0  # memory those W tasks hold (inputs and output gradients of the linear layers)
    peak_pending_w_bytes: int = 0
    # Observed waiting: seconds this stage spent idle waiting for input of each kind (moving averages).
    wait_f: float = 0.0
    wait_b: float = 0.0
    # Free memory headroom as a fraction in [0, 1] when the executor can measure it, else None.
    memory_headroom: float | None = None

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.pp + self.stage

    def note_wait(self, kind: str, waited: float) -> None:
        """Fold `waited` idle seconds into the moving average of the kind of task that ended the wait."""
        if waited <= 0:
            return
        if kind == "F":
            self.wait_f = 0.7 * self.wait_f + 0.3 * waited
        else:
            self.wait_b = 0.7 * self.wait_b + 0.3 * waited

    @property
    def num_virtual(self) -> int:
        return self.pp * self.vpp

    def total_tasks(self) -> int:
        return (3 if self.split else 2) * self.vpp * self.microbatches

    def finished(self) -> bool:
        return len(self.done) == self.total_tasks()


class Policy(Protocol):
    name: str

    def reset(self, view: StageView) -> None:
        """Called once per step before the first task."""

    def next_task(self, ready: Sequence[Task], view: StageView) -> Task | None:
        """Pick a task from `ready` (tasks whose inputs are here and that are not done), or None to wait."""

    def on_done(self, task: Task, view: StageView) -> None:
        """Called after `task` ran (the view's counters already updated)."""


def all_tasks(vpp: int, microbatches: int, split: bool = False) -> list[Task]:
    kinds = ("F", "B", "W") if split else ("F", "B")
    return [Task(k, c, m) for k in kinds for c in range(vpp) for m in range(microbatches)]


def is_first_virtual(view: StageView, chunk: int) -> bool:
    return view.virtual_stage(chunk) == 0


def is_last_virtual(view: StageView, chunk: int) -> bool:
    return view.virtual_stage(chunk) == view.num_virtual - 1
