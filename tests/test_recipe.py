"""The default recipe trains the embedded default model without loss spikes (the demo's model, batch and data).

Rule (issue 15): after the first 10 steps, no step's loss is above 1.5x the median of the 10 steps before it.
The tp2 x pp2 demo computes the same losses as one process (the equivalence suite), so one process checks it.
"""
from __future__ import annotations

import statistics

import pytest

from megatronapp.config import ParallelConfig, RunConfig, preset
from megatronapp.demo import demo_recipe
from megatronapp.parallel import comm


def spikes(losses: list[float], window: int = 10, factor: float = 1.5) -> list[tuple[int, float, float]]:
    """(step, loss, median of the previous `window`) for every step that breaks the rule."""
    out = []
    for i in range(window, len(losses)):
        med = statistics.median(losses[i - window:i])
        if losses[i] > factor * med:
            out.append((i + 1, losses[i], med))
    return out


def _losses(tmp_path, steps: int, **recipe) -> list[float]:
    """The first `steps` losses of the demo's 400-step schedule (the LR schedule depends on the total)."""
    from megatronapp.train.trainer import Trainer

    train = demo_recipe(400, str(tmp_path))
    for k, v in recipe.items():
        setattr(train, k, v)
    train.progress = False
    cfg = RunConfig(model=preset("gpt2-tiny"), parallel=ParallelConfig(microbatches=4), train=train)
    comm.reset()
    tr = Trainer(cfg, 0)
    return [tr.train_step()["loss"] for _ in range(steps)]


def test_spike_rule():
    assert spikes([5.0] * 10 + [7.6]) == [(11, 7.6, 5.0)]
    assert spikes([5.0] * 10 + [7.4, 3.0]) == []


@pytest.mark.slow
def test_default_recipe_has_no_loss_spike(tmp_path):
    losses = _losses(tmp_path / "default", 40)
    assert spikes(losses) == [], losses
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.slow
def test_the_old_recipe_spikes_so_the_check_can_fail(tmp_path):
    losses = _losses(tmp_path / "old", 14, lr=3e-3, min_lr=3e-4, warmup_steps=5)
    assert [s[0] for s in spikes(losses)] == [11], losses
