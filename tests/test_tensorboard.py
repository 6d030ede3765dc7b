"""TensorBoard logs of a run restarted from a checkpoint show each step once, with the value the run kept."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorboard")


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [(e.step, e.value) for e in EventAccumulator(str(logdir)).Reload().Scalars("loss")]


def test_replayed_steps_replace_the_failed_attempts_values(tmp_path):
    from megatronapp.train.tensorboard import TensorBoardLog

    first = TensorBoardLog(tmp_path)  # the attempt that failed after logging step 5 (checkpoint at step 3)
    for step in range(1, 6):
        first.log({"step": step, "loss": 10.0 + step})
    first.close()
    resumed = TensorBoardLog(tmp_path, resumed_at=3)  # the restarted attempt replays steps 4 and 5, then goes on
    for step in range(4, 8):
        resumed.log({"step": step, "loss": 20.0 + step})
    resumed.close()
    assert _scalars(tmp_path) == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0), (7, 27.0)]


def test_a_fresh_run_purges_nothing(tmp_path):
    from megatronapp.train.tensorboard import TensorBoardLog

    a = TensorBoardLog(tmp_path)
    a.log({"step": 1, "loss": 1.0})
    a.close()
    b = TensorBoardLog(tmp_path, resumed_at=0)
    b.log({"step": 2, "loss": 2.0})
    b.close()
    assert _scalars(tmp_path) == [(1, 1.0), (2, 2.0)]
