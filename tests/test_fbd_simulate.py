"""The MegaFBD step model (fbd/simulate.py): limits that can be computed by hand."""
from __future__ import annotations

import pytest

from megatronapp.fbd import simulate as sim


def test_instant_forward_gives_the_backward_chain_bubble():
    # inputs always ready: microbatches run through the pp stages as a chain, (M + pp - 1) task times
    assert sim.fbd_step(pp=4, microbatches=8, n_f=1, t_fwd=0.0, t_bwd=1.0) == pytest.approx(11.0)


def test_a_slow_forward_instance_becomes_the_bottleneck_and_more_instances_relieve_it():
    slow = sim.fbd_step(pp=2, microbatches=8, n_f=1, t_fwd=1.0, t_bwd=1.0, k=4)
    # one instance makes a job every k*(pp-1)*t_fwd = 4: the last input is ready at 4*7 + 4 = 32
    assert slow == pytest.approx(32 + 2)
    n = sim.balanced_instances(pp=2, t_fwd=1.0, t_bwd=1.0, k=4)
    assert n == 4
    assert sim.fbd_step(pp=2, microbatches=8, n_f=n, t_fwd=1.0, t_bwd=1.0, k=4) < slow


def test_coupled_1f1b_formula():
    assert sim.coupled_step(pp=2, microbatches=8, t_fwd=1.0, t_bwd_only=2.0) == pytest.approx(27.0)
