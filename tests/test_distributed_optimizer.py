"""ZeRO-1 (`--zero 1`): sharded optimizer state that trains like the plain run, resumes bit-exactly from its
per-rank shards, holds about 1/dp of the optimizer memory, and is refused where it does not apply.

Equivalence with one process (tp, pp, vpp, dpp, clipping, LAMB, both comm semantics) is in
`test_engine_equivalence.py`; this file checks what that harness cannot see.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatronapp.config import ConfigError, RunConfig, validate
from megatronapp.parallel.distributed_optimizer import DistributedOptimizer, optimizer_state_bytes
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.consolidate import VOCAB_WEIGHTS, consolidate
from megatronapp.train.trainer import Trainer, train
from tests.engine_cases import base_case
from tests.jobs import train_case as _cfg


def test_zero_values_and_fbd_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="parallel.zero=2"):
        validate(RunConfig.from_dict(base_case("gpt2", **{"parallel.zero": 2})))
    with pytest.raises(ConfigError, match="parallel.zero=1 does not combine with parallel.fbd"):
        validate(RunConfig.from_dict(base_case("gpt2", **{"parallel.zero": 1, "parallel.fbd": True})))
    validate(RunConfig.from_dict(base_case("gpt2", **{"parallel.zero": 1})))  # dp=1: allowed, one shard


def test_parameters_that_are_not_fp32_are_refused(tmp_path):
    tr = Trainer(RunConfig.from_dict(_cfg(tmp_path / "run")))
    tr.chunks[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="parallel.zero=1 needs fp32 parameters.*bfloat16"):
        DistributedOptimizer(tr.chunks, tr.topo, tr.cfg.train)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_one_rank_zero_steps_exactly_like_the_plain_optimizer(tmp_path, optimizer):
    """At dp=1 the one shard is every parameter: same bits as torch's AdamW (and our LAMB) on whole tensors."""
    runs = {}
    for zero in (0, 1):
        tr = Trainer(RunConfig.from_dict(_cfg(tmp_path / f"z{zero}", **{
            "parallel.zero": zero, "train.optimizer": optimizer, "train.weight_decay": 0.1})))
        losses = [tr.train_step()["loss"] for _ in range(3)]
        runs[zero] = (losses, {n: p.detach().clone() for c in tr.chunks for n, p in c.named_parameters()})
        if zero:
            assert isinstance(tr.optimizer, DistributedOptimizer)
    assert runs[0][0] == runs[1][0]
    for name, t in runs[0][1].items():
        assert torch.equal(t, runs[1][1][name]), name


@pytest.mark.slow
def test_dp2_zero_resumes_bit_exactly_and_holds_half_the_optimizer_state(tmp_path):
    over = {"parallel.dp": 2, "train.steps": 4, "train.save_interval": 2, "train.optimizer": "adamw",
            "train.weight_decay": 0.1}
    whole = train(RunConfig.from_dict(_cfg(tmp_path / "zero", **over, **{"parallel.zero": 1})), threads=1)
    # plain DP holds the whole state on every rank, whatever dp: one process measures what each of its ranks holds
    plain = Trainer(RunConfig.from_dict(_cfg(tmp_path / "plain", **{"train.optimizer": "adamw"})))
    plain.train_step()
    plain_bytes = optimizer_state_bytes(plain.optimizer)
    assert 0 < whole["optimizer_state_bytes"] <= 0.55 * plain_bytes, (whole["optimizer_state_bytes"], plain_bytes)
    summary = json.loads((tmp_path / "zero" / "summary.json").read_text())
    assert summary["optimizer_state_bytes"] == whole["optimizer_state_bytes"]

    # stop at step 2, resume from its per-rank shards to step 4: every bit equals the uninterrupted run
    mid = ckpt.step_dir(tmp_path / "zero" / "checkpoints", 2)
    cfg = _cfg(tmp_path / "resumed", **over, **{"parallel.zero": 1})
    cfg["train"]["resume"] = str(mid)
    resumed = train(RunConfig.from_dict(cfg), threads=1)
    assert resumed["losses"] == whole["losses"][2:]
    a, b = ckpt.step_dir(tmp_path / "zero" / "checkpoints", 4), ckpt.step_dir(tmp_path / "resumed" / "checkpoints", 4)
    states = [ckpt.load_rank(a, rank) for rank in (0, 1)]
    for rank, sa in enumerate(states):
        sb = ckpt.load_rank(b, rank)
        assert sa["optimizer"]["zero"] == 1 and sa["optimizer"]["dp_rank"] == rank  # each rank saved its shard
        _assert_equal(sa["chunks"], sb["chunks"], f"rank {rank} weights")
        _assert_equal(sa["optimizer"], sb["optimizer"], f"rank {rank} optimizer state")
    # the two ranks' shards are disjoint halves: their moments together cover the model once (plus padding)
    n_model = sum(p.numel() for p in plain.params)
    n_moment = sum(st["exp_avg"].numel() for s in states for st in s["optimizer"]["inner"]["state"].values())
    assert n_model <= n_moment < n_model + 2 * 64, (n_model, n_moment)
    # one model comes back from a sharded-optimizer checkpoint: the weights every DP rank holds
    _, full = consolidate(a)
    for name, t in full.items():
        src = states[1]["chunks"][0][name]
        assert torch.equal(t, src[:t.shape[0]] if name in VOCAB_WEIGHTS else src), name
    # and it exports to Hugging Face (the model only: optimizer shards are left behind)
    from megatronapp.train.export import export_hf
    from tests.hf_checks import assert_exported_matches

    assert_exported_matches(a, export_hf(a, tmp_path / "hf"), "Snow is white.")


def _assert_equal(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_equal(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_equal(u, v, f"{where}[{i}]")
    else:
        assert x == y, where
