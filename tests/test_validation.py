"""Validation loss (`--eval-interval`): a held-out split training never reads, forward only, no state change.

That parallel layouts evaluate exactly like one process is checked by the equivalence harness (every case of
tests/test_engine_equivalence.py evaluates after its two steps); the run-level files (metrics.jsonl, summary.json,
TensorBoard, loss plot) by tests/test_training.py's tp2 x pp2 run.
"""
from __future__ import annotations

import pytest
import torch

from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import ConfigError, RunConfig, validate
from megatronapp.data.corpus import embedded_corpus, embedded_validation
from megatronapp.train.trainer import Trainer
from tests.engine_cases import base_case


def test_held_out_split_is_text_training_never_reads():
    train = embedded_corpus()
    valid = embedded_validation()
    assert len(valid) > 30_000
    train_paragraphs = set(train.splitlines())
    held = [p for p in valid.splitlines() if p]
    # paragraphs are 3-6 random sentences: a whole one repeating by chance is rare, and not the split's doing
    assert sum(p in train_paragraphs for p in held) <= 2, "the held-out split copies training paragraphs"
    assert valid not in train


def _trainer(tmp_path, **over) -> Trainer:
    d = base_case("llama", **{"model.num_layers": 2, "train.eval_interval": 1, "train.eval_iters": 2, **over})
    d["train"]["out"] = str(tmp_path)
    return Trainer(RunConfig.from_dict(d))


def test_evaluate_changes_no_weight_or_optimizer_state_and_repeats(tmp_path):
    tr = _trainer(tmp_path)
    tr.train_step()
    params = [p.detach().clone() for p in tr.params]
    grads = [None if p.grad is None else p.grad.clone() for p in tr.params]
    state = {k: v.clone() for s in tr.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    a, b = tr.evaluate(), tr.evaluate()
    assert a == b and 0 < a < 10
    assert all(torch.equal(p, q) for p, q in zip(params, tr.params))
    assert all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, tr.params))
    after = {k: v for s in tr.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert all(torch.equal(state[k], after[k]) for k in state)
    # the mean of the first eval_iters held-out batches, through the one-process model
    with torch.no_grad():
        want = sum(float(tr.chunks[0](*tr.valid.get(i)[:1], labels=tr.valid.get(i)[1])) for i in range(2)) / 2
    assert a == pytest.approx(want, abs=1e-6)
    tr.close()


def test_evaluate_without_a_held_out_split_says_how_to_get_one(tmp_path):
    tr = _trainer(tmp_path, **{"train.eval_interval": 0})
    with pytest.raises(RuntimeError, match="--eval-interval"):
        tr.evaluate()


@pytest.mark.parametrize("over, match", [
    ({"train.eval_interval": -1}, "eval_interval=-1"),
    ({"train.eval_interval": 5, "train.eval_iters": 0}, "eval_iters=0"),
    ({"train.eval_interval": 5, "train.data": "corpus.txt"}, "--valid-data"),
])
def test_bad_validation_settings_are_refused_by_name(over, match):
    with pytest.raises(ConfigError, match=match):
        validate(RunConfig.from_dict(base_case("gpt2", **over)))


def test_flags_set_the_validation_fields():
    args = build_parser().parse_args(["train", "--eval-interval", "5", "--eval-iters", "2",
                                      "--valid-data", "v.txt"])
    t = config_from_args(args).train
    assert (t.eval_interval, t.eval_iters, t.valid_data) == (5, 2, "v.txt")
