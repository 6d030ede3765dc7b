"""The LAMB-at-4x-batch experiment: both optimizers get the same tokens, LAMB in a quarter of the steps."""
from __future__ import annotations

import math

import pytest

bench = pytest.importorskip("benchmarks.bench_lamb_batch")


def test_same_tokens_quarter_steps(tmp_path):
    data = bench.held_out(4)
    tokens = 4 * bench.BATCH * bench.SEQ
    adamw = bench.train_run("adamw", 2e-3, bench.BATCH, tokens, data, str(tmp_path / "a"))
    lamb = bench.train_run("lamb", 1e-2, 4 * bench.BATCH, tokens, data, str(tmp_path / "l"))
    assert (adamw["steps"], lamb["steps"]) == (4, 1)
    assert adamw["eval"][-1]["tokens"] == lamb["eval"][-1]["tokens"] == tokens
    assert adamw["eval"][0]["loss"] == pytest.approx(lamb["eval"][0]["loss"])  # same initial model
    assert all(math.isfinite(x) for r in (adamw, lamb) for x in r["train_loss"])
    assert adamw["final_eval"] < adamw["eval"][0]["loss"]


def test_verdict_says_when_lamb_falls_short():
    result = {"best": {"adamw": {"lr": 2e-3, "final_eval": 1.0}, "lamb": {"lr": 1e-2, "final_eval": 1.3}},
              "lamb_minus_adamw_eval": 0.3}
    assert "does not match" in bench.verdict_of(result)
    result["best"]["lamb"]["final_eval"], result["lamb_minus_adamw_eval"] = 1.01, 0.01
    assert "matches" in bench.verdict_of(result)
