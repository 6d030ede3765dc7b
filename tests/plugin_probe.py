"""A user plug-in for tests/test_plugins.py, attached by import path ("tests.plugin_probe:plugin"): it appends every
lifecycle hook it receives to `<out>/hooks.rank<R>.jsonl`, one JSON line per event."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _recorder(trainer: Any):
    path = Path(trainer.out) / f"hooks.rank{trainer.rank}.jsonl"

    def record(event: str, **info: Any) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"event": event, **info}) + "\n")

    return record


def plugin(trainer: Any) -> None:
    """Record every hook with what it was given."""
    record = _recorder(trainer)
    hooks = trainer.hooks
    hooks.on("rank_start", lambda tr: record("rank_start", same_trainer=tr is trainer, step=tr.step))
    hooks.on("step_start", lambda step: record("step_start", step=step))
    hooks.on("step_end", lambda step, rec: record("step_end", step=step, loss=rec["loss"]))
    hooks.on("checkpoint_saved", lambda step, path: record("checkpoint_saved", step=step, path=str(path),
                                                           complete=(Path(path) / "COMPLETE").is_file()))
    hooks.on("failure", lambda exc: record("failure", error=repr(exc)))
    hooks.on("shutdown", lambda: record("shutdown"))


def fail_at_second_step(trainer: Any) -> None:
    """Raise from step_start of step 1, to drive the failure path."""
    def boom(step: int) -> None:
        if step == 1:
            raise RuntimeError("probe failure at step 1")

    trainer.hooks.on("step_start", boom)


NOT_CALLABLE = 3


PACE_S = 0.4


def paced_steps(trainer: Any) -> None:
    """Sleep PACE_S after every step: a run lasts long enough for a test's signals to land mid-run on a fast
    machine (the sleep changes no number, so the run still equals an unpaced one bit for bit)."""
    import time

    trainer.hooks.on("step_end", lambda step, rec: time.sleep(PACE_S))
