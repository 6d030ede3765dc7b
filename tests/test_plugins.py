"""The plug-in seam: entries resolve by import path (or fail naming the entry), the module flags translate into
entries, and a user plug-in receives every lifecycle hook in order on real ranks, and on a failing run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp import config as C
from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import ConfigError, RunConfig, load_yaml, plugin_entries
from megatronapp.train import plugins
from megatronapp.train.trainer import make_policy, run_rank, train
from tests.engine_cases import base_case

PROBE = "tests.plugin_probe:plugin"


def _events(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"hooks.rank{rank}.jsonl").read_text().splitlines()]


def test_module_flags_become_entries_in_order():
    cfg = RunConfig(inject=["slow-compute=0:2"], scope_port=0, attach=["tests.plugin_probe", PROBE, "a.b:c"])
    assert plugin_entries(cfg) == [C.INJECT_PLUGIN, C.SCOPE_PLUGIN, PROBE, "a.b:c"]  # "mod" means "mod:plugin", once
    cfg.trace.enabled = True
    assert plugin_entries(cfg)[0] == C.TRACE_PLUGIN  # the tracer first: injected delays fall inside its spans
    assert plugin_entries(RunConfig()) == []
    for entry in (C.TRACE_PLUGIN, C.INJECT_PLUGIN, C.SCOPE_PLUGIN):
        assert callable(plugins.resolve(entry))


def test_attach_from_yaml_and_repeatable_flag(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(f"attach:\n  - {PROBE}\n")
    assert load_yaml(y).attach == [PROBE]
    args = build_parser().parse_args(["train", "--config", str(y), "--attach", "x.y:f", "--attach", "z"])
    assert config_from_args(args).attach == [PROBE, "x.y:f", "z"]
    y.write_text(f"attach: {PROBE}\n")  # a bare string, not a list
    with pytest.raises(ConfigError, match="attach must be a list"):
        load_yaml(y)


@pytest.mark.parametrize("entry, why", [
    ("tests.no_such_module:plugin", "cannot import module 'tests.no_such_module'"),
    ("tests.plugin_probe:nope", "has no attribute 'nope'"),
    ("tests.plugin_probe:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
    ("", "expected an import path"),
])
def test_bad_entries_are_named(entry, why):
    with pytest.raises(ConfigError, match=f"attach entry {entry!r}: .*{why}"):
        plugins.resolve(entry)


def test_bad_entry_fails_before_any_rank_starts(tmp_path):
    cfg = RunConfig.from_dict(base_case("gpt2", **{"parallel.pp": 2, "train.out": str(tmp_path)}))
    cfg.attach = ["tests.plugin_probe:nope"]
    with pytest.raises(ConfigError, match="tests.plugin_probe:nope"):
        train(cfg)


def test_teardown_runs_every_callback_last_registered_first():
    hooks, calls = plugins.Hooks(), []

    def failing() -> None:
        calls.append("second")
        raise RuntimeError("second failed")

    hooks.on("shutdown", lambda: calls.append("first"))
    hooks.on("shutdown", failing)
    hooks.on("shutdown", lambda: calls.append("third"))
    with pytest.raises(RuntimeError, match="second failed"):
        hooks.teardown("shutdown")
    assert calls == ["third", "second", "first"]
    with pytest.raises(ValueError, match="unknown hook event 'step_begin'"):
        hooks.on("step_begin", print)


def test_dpp_schedule_policy_comes_through_the_registry():
    from megatronapp.dpp.policies import BFSPolicy
    from megatronapp.pipeline.schedules import StaticPolicy

    cfg = RunConfig.from_dict(base_case("gpt2", **{"parallel.schedule": "dpp", "parallel.dpp_policy": "bfs"}))
    assert isinstance(make_policy(cfg), BFSPolicy)
    assert isinstance(make_policy(RunConfig()), StaticPolicy)


@pytest.mark.slow
def test_user_plugin_gets_every_hook_in_order_on_two_ranks(tmp_path):
    d = base_case("gpt2", **{"parallel.pp": 2, "train.steps": 2, "train.save_interval": 1,
                             "train.out": str(tmp_path), "train.peak_tflops": 1.0})
    cfg = RunConfig.from_dict(d)
    cfg.attach = [PROBE]
    train(cfg, threads=1)
    for rank in (0, 1):
        ev = _events(tmp_path, rank)
        assert [e["event"] for e in ev] == ["rank_start", "step_start", "step_end", "checkpoint_saved",
                                            "step_start", "step_end", "checkpoint_saved", "shutdown"], rank
        assert ev[0] == {"event": "rank_start", "same_trainer": True, "step": 0}
        assert [e["step"] for e in ev[1:-1]] == [0, 1, 1, 1, 2, 2]
        saved = [e for e in ev if e["event"] == "checkpoint_saved"]
        assert [Path(e["path"]).name for e in saved] == ["step_00000001", "step_00000002"]
        assert all(e["complete"] for e in saved)  # fired once the directory is complete, on every rank
    # both ranks saw the same global loss, the one the run logged
    logged = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        assert [e["loss"] for e in _events(tmp_path, rank) if e["event"] == "step_end"] == logged


def test_failure_hook_then_shutdown_and_the_error_propagates(tmp_path):
    d = base_case("gpt2", **{"model.num_layers": 2, "train.steps": 3, "train.out": str(tmp_path),
                             "train.peak_tflops": 1.0})
    d["attach"] = [PROBE, "tests.plugin_probe:fail_at_second_step"]
    with pytest.raises(RuntimeError, match="probe failure at step 1"):
        run_rank(0, 1, d)
    ev = _events(tmp_path, 0)
    assert [e["event"] for e in ev] == ["rank_start", "step_start", "step_end", "step_start", "failure",
                                        "shutdown"]
    assert "probe failure at step 1" in ev[4]["error"]

