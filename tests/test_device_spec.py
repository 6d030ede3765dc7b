"""The `--emulate-device SPEC` grammar (device_spec.py): every key parsed, every bad spec refused with a
ConfigError naming the key and the fix, in the launching process (config.validate) before any rank starts --
including specs that used to hang or crash a rank (issue 40, item 6)."""
from __future__ import annotations

import re
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.cli import build_parser, config_from_args, main
from megatronapp.config import ConfigError, RunConfig, validate
from megatronapp.device_spec import MAX_TASK_S, check_spec, parse_spec
from tests import engine_cases as ec


def _validate(spec: str, **over) -> None:
    validate(RunConfig.from_dict({**ec.base_case(**over), "emulate_device": spec}))


def test_spec_parses_every_key_and_refuses_bad_ones():
    s = parse_spec("tflops=0.001,jitter=lognormal:0.5,speed=1:0.5,speed=4-5:2,speed=2+7:0.25,seed=3,"
                   "host_share=0.3")
    assert (s.tflops, s.sigma, s.seed, s.host_share) == (0.001, 0.5, 3, 0.3)
    assert [s.speed_of(r) for r in range(8)] == [1.0, 0.5, 0.25, 1.0, 2.0, 2.0, 1.0, 0.25]
    for bad, words in [("", "empty"), ("jitter=lognormal:0.5", "tflops=T is required"), ("tflops=0", "> 0"),
                       ("tflops=x", "must be a number"), ("tflops=1,gpu=3", "unknown key 'gpu'"),
                       ("tflops=1,jitter=normal:1", "lognormal"), ("tflops=1,speed=1", "RANKS:FACTOR"),
                       ("tflops=1,speed=a:1", "speed ranks"), ("tflops=1,tflops=2", "given twice"),
                       ("tflops=1,seed=1.5", "integer"), ("tflops", "KEY=VALUE")]:
        with pytest.raises(ConfigError, match=words):
            parse_spec(bad)
    with pytest.raises(ConfigError, match="rank 4, which does not exist in a world of 4"):
        check_spec("tflops=1,speed=4:2", 4)
    cfg = RunConfig.from_dict({**ec.base_case(**{"parallel.pp": 2}), "emulate_device": "tflops=1,speed=3:2"})
    with pytest.raises(ConfigError, match="rank 3, which does not exist"):
        validate(cfg)
    with pytest.raises(ConfigError, match="emulate_device must be a string"):
        RunConfig.from_dict({"emulate_device": 3})


def test_later_speed_entries_win_and_the_slowest_rank_is_found_without_expanding():
    s = parse_spec("tflops=1,speed=0-999:0.5,speed=10-19:0.25,speed=12:3")
    assert [s.speed_of(r) for r in (0, 9, 10, 12, 19, 20, 999, 1000)] == [0.5, 0.5, 0.25, 3.0, 0.25, 0.5, 0.5, 1.0]
    assert s.slowest(1000) == 0.25 and s.slowest(10) == 0.5 and parse_spec("tflops=1").slowest(4) == 1.0
    assert parse_spec("tflops=1,speed=0-1:0.1,speed=0-1:2").slowest(2) == 2.0  # the overridden entry is not used


def test_a_range_of_ranks_is_checked_before_it_is_expanded():
    tracemalloc.start()
    try:
        spec = parse_spec("tflops=1,speed=0-999999:0.5")  # a million ranks: tens of MB when expanded
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert spec.speed_of(999_999) == 0.5 and spec.speed_of(1_000_000) == 1.0
    with pytest.raises(ConfigError, match="speed names rank 4, which does not exist in a world of 4"):
        check_spec("tflops=1,speed=0-999999999999:0.5", 4)
    with pytest.raises(ConfigError, match="speed names rank 8, which does not exist"):
        _validate("tflops=1,speed=1:2,speed=2+8-999999999999:0.5", **{"parallel.dp": 8, "parallel.microbatches": 1})


@pytest.mark.parametrize("spec, key", [
    ("tflops=1e-9", "tflops=1e-09 makes"),  # used to hang: hours of sleep per task
    ("tflops=1e-300", "tflops=1e-300 makes"),  # used to crash a rank: time.sleep(1e290) is an OverflowError
    ("tflops=1,speed=0:1e-300", "tflops=1 with speed FACTOR 1e-300 makes"),  # likewise, through the speed factor
    ("tflops=1e-300,speed=0:1e-300", "tflops=1e-300 with speed FACTOR 1e-300"),  # the rate underflows to 0
])
def test_a_device_too_slow_to_finish_is_refused_before_ranks_start(spec, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as e:
        _validate(spec)
    assert f"over the {MAX_TASK_S:g} s a task may take" in str(e.value) and "raise tflops to at least" in str(e.value)


def test_the_device_time_bound_is_the_one_the_message_names():
    with pytest.raises(ConfigError) as e:
        _validate("tflops=1e-9,speed=1:0.5", **{"parallel.pp": 2})
    assert "speed FACTOR 0.5" in str(e.value) and "or the speed FACTOR" in str(e.value)
    need = float(re.search(r"at least ([0-9.e+-]+)", str(e.value)).group(1))
    _validate(f"tflops={need * 1.01},speed=1:0.5", **{"parallel.pp": 2})  # just fast enough: accepted
    with pytest.raises(ConfigError, match="raise tflops"):
        _validate(f"tflops={need * 0.99},speed=1:0.5", **{"parallel.pp": 2})
    _validate("tflops=0.001,jitter=lognormal:0.5")  # what the tests and benchmarks use


def test_a_negative_seed_is_refused_in_the_launching_process(tmp_path, capsys):
    with pytest.raises(ConfigError, match="seed=-1 must be >= 0"):
        _validate("tflops=1,jitter=lognormal:0.5,seed=-1")
    code = main(["train", "--emulate-device", "tflops=1,jitter=lognormal:0.5,seed=-1", "--steps", "1",
                 "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "configuration error" in err and "seed=-1 must be >= 0" in err
    assert not list(tmp_path.iterdir())  # refused before the run made anything


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_spec_is_refused_not_ignored(spec):
    cfg = config_from_args(build_parser().parse_args(["train", "--emulate-device", spec]))
    assert cfg.emulate_device == spec
    with pytest.raises(ConfigError, match="empty spec: give at least tflops=T"):
        validate(cfg)
    assert config_from_args(build_parser().parse_args(["train"])).emulate_device is None  # no flag: no emulation


_parts = st.one_of(
    st.builds("tflops={}".format, st.one_of(st.floats(allow_nan=True), st.sampled_from(["1e-9", "1e-300", "x"]))),
    st.builds("jitter=lognormal:{}".format, st.floats(allow_nan=True)),
    st.builds("speed={}-{}:{}".format, st.integers(-5, 2**64), st.integers(-5, 2**64), st.floats(allow_nan=True)),
    st.builds("speed={}:{}".format, st.integers(-5, 2**64), st.floats(allow_nan=True)),
    st.builds("seed={}".format, st.integers(-2**70, 2**70)),
    st.builds("host_share={}".format, st.floats(allow_nan=True)),
    st.text(max_size=12))


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(_parts, max_size=5), world=st.integers(1, 64), flops=st.floats(1.0, 1e15))
def test_any_spec_is_accepted_within_bounds_or_refused_by_name(parts, world, flops):
    text = ",".join(parts)
    tracemalloc.start()
    try:
        spec = check_spec(text, world, task_flops=flops)
    except ConfigError as e:
        assert str(e).startswith(f"--emulate-device {text!r}: ") and len(str(e)) < 2000
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1_000_000, peak
    slowest = spec.slowest(world)
    assert flops / (spec.rate * slowest) <= MAX_TASK_S and spec.seed >= 0
    assert all(0 <= lo <= hi < world for lo, hi, _ in spec.speed)
