"""Impossible configs are refused before any process starts, with the field and the fix named; help is complete."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megatronapp.cli import build_parser, config_from_args, main
from megatronapp.config import ConfigError, ModelConfig, RunConfig, load_yaml, validate
from megatronapp.parallel.topology import Topology, coord_of, rank_of
from megatronapp.partition import split_layers
from megatronapp.pipeline.schedules import check_orders, stage_orders


def _cfg(**kw) -> RunConfig:
    cfg = RunConfig()
    for key, value in kw.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg


@pytest.mark.parametrize("kw, world, message", [
    (dict(parallel__tp=3), None, "model.num_heads=4 is not divisible by parallel.tp=3"),
    (dict(parallel__tp=2, parallel__pp=2), 3, "world size 3 != dp*pp*tp = 1*2*2 = 4"),
    (dict(parallel__pp=8), None, "model.num_layers=4 < pp*vpp = 8*1 = 8"),
    (dict(parallel__pp=2, parallel__vpp=2, parallel__schedule="1f1b"), None, "needs an interleaved schedule"),
    (dict(parallel__schedule="zigzag"), None, "parallel.schedule='zigzag'"),
    (dict(train__global_batch_size=6, parallel__microbatches=4), None, "train.global_batch_size=6"),
    (dict(train__seq_len=4096), None, "train.seq_len=4096 exceeds model.max_seq_len=128"),
    (dict(train__optimizer="sgd"), None, "train.optimizer='sgd'"),
    (dict(parallel__dpp_max_inflight=0), None, "parallel.dpp_max_inflight=0"),
    (dict(parallel__pp=2, parallel__vpp=2, parallel__schedule="dpp", parallel__dpp_max_inflight=1), None,
     "parallel.dpp_max_inflight=1 is below the minimum 2"),
    (dict(parallel__tp=2, parallel__sequence_parallel=True, train__seq_len=63), None, "train.seq_len=63"),
    (dict(parallel__tp=2, parallel__tp_comm_overlap=True), None, "add --sequence-parallel with --tp > 1"),
    (dict(parallel__tp=2, parallel__sequence_parallel=True, parallel__tp_comm_overlap=True,
          parallel__tp_comm_overlap_chunks=3, train__seq_len=64), None, "parallel.tp_comm_overlap_chunks=3"),
])
def test_impossible_configs_name_the_field(kw, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        validate(_cfg(**kw), world)


def test_model_config_errors():
    with pytest.raises(ConfigError, match="model.family='bert'"):
        ModelConfig(family="bert")
    with pytest.raises(ConfigError, match="not divisible by model.num_kv_heads=3"):
        validate(RunConfig(model=ModelConfig(family="llama", num_heads=4, num_kv_heads=3)))


def test_yaml_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError, match="model.hiden_size"):
        load_yaml(bad)
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  family: llama\n  num_kv_heads: 2\nparallel:\n  tp: 2\n  pp: 2\ntrain:\n  steps: 3\n")
    cfg = load_yaml(good)
    assert (cfg.model.family, cfg.parallel.tp, cfg.train.steps, cfg.model.bias) == ("llama", 2, 3, False)


def test_cli_flags_override_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("parallel:\n  tp: 2\ntrain:\n  steps: 9\n")
    args = build_parser().parse_args(["train", "--config", str(y), "--steps", "4", "--hidden", "64",
                                      "--inject", "slow-compute=1:1.5"])
    cfg = config_from_args(args)
    assert (cfg.parallel.tp, cfg.train.steps, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (2, 4, 64, 256)
    assert cfg.inject == ["slow-compute=1:1.5"]
    assert (cfg.parallel.dp_overlap, cfg.parallel.pp_overlap) == (True, True)
    off = config_from_args(build_parser().parse_args(["train", "--no-dp-overlap", "--no-pp-overlap"]))
    assert (off.parallel.dp_overlap, off.parallel.pp_overlap) == (False, False)


def test_data_pipeline_and_tensorboard_flags_reach_the_config():
    cfg = config_from_args(build_parser().parse_args(["train", "--data-prefetch", "0", "--tensorboard", "runs/tb"]))
    assert (cfg.train.data_prefetch, cfg.train.tensorboard) == (0, "runs/tb")
    default = config_from_args(build_parser().parse_args(["train"]))
    assert (default.train.data_prefetch, default.train.tensorboard) == (2, None)
    default.train.data_prefetch = -1
    with pytest.raises(ConfigError, match=r"train.data_prefetch=-1 must be >= 0"):
        validate(default)


def test_cli_refuses_before_starting_processes(capsys):
    code = main(["train", "--nproc", "3", "--tp", "2", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "configuration error" in err and "--nproc" in err


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "megatronapp", "--help"], capture_output=True, text=True).stdout
    for cmd in ("demo", "train", "scan", "dpp", "scope"):
        assert cmd in out
    out = subprocess.run([sys.executable, "-m", "megatronapp", "train", "--help"], capture_output=True,
                         text=True).stdout
    for flag in ("--tp", "--pp", "--dp", "--vpp", "--schedule", "--microbatches", "--resume", "--trace", "--inject",
                 "--dtype", "--recompute", "--sequence-parallel", "--hf"):
        assert flag in out


def test_topology_grid_round_trips():
    topo = Topology(tp=2, pp=3, dp=2)
    seen = set()
    for r in range(12):
        c = coord_of(r, 2, 3, 2)
        assert rank_of(c, 2, 2) == r
        seen.add((c.dp, c.pp, c.tp))
    assert len(seen) == 12
    assert topo.tp_ranks(5) == (4, 5) and topo.dp_ranks(5) == (5, 7) and topo.pp_ranks(5) == (1, 5, 9)
    assert "DP0-PP1-TP1" in topo.describe()


def test_partition_uneven_and_refused():
    assert split_layers(8, 4, 1) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    ranges = split_layers(7, 2, 2)
    assert ranges[0][0] == 0 and ranges[-1][1] == 7 and sorted(e - s for s, e in ranges) == [1, 2, 2, 2]
    assert [e - s for s, e in ranges][0] == 1 or [e - s for s, e in ranges][-1] == 1  # ends carry the head
    with pytest.raises(ConfigError, match="every pipeline chunk needs a layer"):
        split_layers(3, 2, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_static_schedules_never_deadlock(schedule):
    for pp in range(1, 9):
        for vpp in ([1] if schedule == "1f1b" else [1, 2, 3, 4]):
            for m in range(1, 17):
                orders = stage_orders(schedule, pp, vpp, m)
                assert check_orders(orders, pp, vpp, m)
                for s in range(pp):
                    assert len(orders[s]) == 2 * vpp * m and len(set(orders[s])) == 2 * vpp * m


def test_deadlock_check_catches_a_bad_order():
    good = stage_orders("1f1b", 2, 1, 2)
    bad = [list(reversed(good[0])), good[1]]  # stage 0 would start with a backward it cannot have
    assert not check_orders(bad, 2, 1, 2)


def test_resume_alone_continues_the_saved_job(tmp_path):
    """`train --resume DIR` with no other flags takes the layout and settings saved in the checkpoint."""
    from megatronapp.train.trainer import Trainer

    cfg = RunConfig()
    cfg.model = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, max_seq_len=32)
    cfg.train.seq_len, cfg.train.steps, cfg.train.out, cfg.train.peak_tflops = 16, 3, str(tmp_path / "a"), 1.0
    cfg.parallel.microbatches = 2
    tr = Trainer(cfg)
    tr.train_step()
    d = tr.save()
    args = build_parser().parse_args(["train", "--resume", str(tmp_path / "a" / "checkpoints" / "latest"),
                                      "--steps", "5"])
    resumed = config_from_args(args)
    assert resumed.model.hidden_size == 32 and resumed.parallel.microbatches == 2 and resumed.train.steps == 5
    assert resumed.train.resume == str(tmp_path / "a" / "checkpoints" / "latest")
    assert Trainer(resumed).step == 1 and d.name == "step_00000001"
    for steps, done_already in (("1", "at step 1"), ("0", "at step 1")):
        args = build_parser().parse_args(["train", "--resume", str(d), "--steps", steps])
        with pytest.raises(ConfigError, match=f"{done_already} and train.steps={steps}: nothing left"):
            config_from_args(args)
    args = build_parser().parse_args(["train", "--resume", str(tmp_path / "nowhere")])
    with pytest.raises(ConfigError, match="--resume"):
        config_from_args(args)


def test_tp_comm_overlap_flags_reach_the_config():
    args = build_parser().parse_args(["train", "--tp", "2", "--sequence-parallel", "--tp-comm-overlap",
                                      "--tp-comm-overlap-chunks", "4"])
    p = config_from_args(args).parallel
    assert p.tp_comm_overlap and p.tp_comm_overlap_chunks == 4
    assert not config_from_args(build_parser().parse_args(["train"])).parallel.tp_comm_overlap
