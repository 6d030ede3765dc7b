"""Fuzzing what a run reads from outside: config files, trace files, heartbeat files and WebSocket messages, and
(tests/fuzz_formats.py, in a child under a memory cap) Kineto traces, summary blocks, Hugging Face configs and
tokenizer files. Every input is accepted or gets the module's own clear error; none raises anything else (a
traceback), hangs or allocates without bound. Example counts are modest: this runs in every suite."""
from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronapp.config import ConfigError, load_yaml
from megatronapp.resilience import watch
from megatronapp.scan.read import format as fmt
from megatronapp.scope import protocol
from tests.memcap import GIB, run_capped

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                            st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                           max_leaves=30)
CONFIG_KEYS = ["model", "parallel", "train", "trace", "inject", "attach", "scope_port", "tp", "steps", "lr"]
config_docs = st.dictionaries(st.sampled_from(CONFIG_KEYS), st.one_of(
    json_values, st.dictionaries(st.sampled_from(["tp", "pp", "steps", "lr", "hidden_size", "out", "x"]),
                                 scalars, max_size=4)), max_size=5)


@FUZZ
@given(doc=st.one_of(config_docs.map(lambda d: json.dumps(d, allow_nan=True)), st.text(max_size=300)))
def test_config_files(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(doc)
    try:
        load_yaml(path)
    except ConfigError as e:
        assert len(str(e)) < 2000


def _block(tag: bytes, payload: bytes) -> bytes:
    return fmt._BLOCK.pack(tag, len(payload), zlib.crc32(payload)) + payload


headers = st.fixed_dictionaries({}, optional={"rank": scalars, "world": scalars, "coord": json_values,
                                              "topo": json_values})
blocks = st.one_of(
    headers.map(lambda h: _block(b"HEAD", json.dumps(h).encode())),
    json_values.map(lambda v: _block(b"STRS", json.dumps(v).encode())),
    json_values.map(lambda v: _block(b"GRPS", json.dumps(v).encode())),
    st.lists(st.tuples(st.sampled_from(["dp", "tp"]), st.fixed_dictionaries(
        {"range": st.lists(st.integers(-2**40, 2**40), min_size=3, max_size=3)})), max_size=2).map(
        lambda v: _block(b"GRPS", json.dumps(v).encode())),
    st.binary(max_size=200).map(lambda b: _block(b"SPAN", b)),
    st.binary(max_size=300).map(lambda b: _block(b"COLS", b)),
    # A column header that claims sizes, then whatever follows: counts and codes from the file never size memory.
    st.tuples(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 255), min_size=12, max_size=12),
              st.binary(max_size=200)).map(
        lambda x: _block(b"COLS", struct.pack("<I12B12q", x[0], *x[1], *([0] * 12)) + x[2])),
    st.binary(max_size=60).map(lambda b: _block(b"FOOT", b)),
    st.binary(max_size=40))


@FUZZ
@given(body=st.lists(blocks, max_size=5))
def test_trace_files(tmp_path_factory, body):
    path = tmp_path_factory.mktemp("trace") / "rank00000.mst"
    path.write_bytes(fmt.MAGIC + b"".join(body))
    try:
        t = fmt.read_rank(path)
    except fmt.TraceFormatError:
        return
    assert 0 <= t.rank < t.world <= fmt.MAX_WORLD


beats = st.fixed_dictionaries(
    {"time": st.one_of(st.builds(time.time), scalars), "step": st.one_of(st.integers(0, 9), scalars),
     "phase": st.one_of(st.just("after step"), scalars)},  # mostly fresh and well-formed: the judge reads on
    optional={k: scalars for k in ("phase_since", "rank", "pid", "label", "round", "start", "tokens_per_s",
                                   "step_time_s", "mem_bytes")} | {"flight": json_values, "open_op": json_values,
                                                                   "layout": json_values})


@FUZZ
@given(beat=st.one_of(beats, json_values))
def test_heartbeat_files(tmp_path_factory, beat):
    hb = tmp_path_factory.mktemp("hb")
    (hb / "rank00000.json").write_text(json.dumps(beat))
    (hb / "rank00001.json").write_text(json.dumps({"time": 1.0, "step": 1, "phase": "after step",
                                                   "phase_since": 0.0, "flight": None}))
    got = watch.read_beats(hb, 2)
    # whatever was accepted, the driver's judgement runs on it without a TypeError
    failure = watch.judge_hang(got, 2, {0: "a", 1: "b"}, 20.0, 10.0, 5.0, None)
    assert failure.kind == "hang"


@FUZZ
@given(msg=st.one_of(
    st.text(max_size=200), st.binary(max_size=200),
    st.dictionaries(st.sampled_from(["type", "token", "prompts", "action", "every", "max_new_tokens", "x"]),
                    json_values, max_size=4).map(lambda d: json.dumps(d)),
    st.fixed_dictionaries({"type": st.sampled_from(["auth", "generate", "control", "ping", "stop", "info"])},
                          optional={"prompts": json_values, "action": scalars, "every": scalars,
                                    "token": scalars}).map(json.dumps)))
def test_websocket_messages(msg):
    try:
        protocol.parse(msg)
    except protocol.ProtocolError as e:
        assert e.reply()["type"] == "error"


@pytest.mark.parametrize("family, cap_gib", [("kineto", 1), ("summary", 1), ("hf_config", 2), ("tokenizer", 1)])
def test_new_formats_under_a_memory_cap(family, cap_gib):
    """Kineto traces, summary blocks, HF configs and tokenizer files (tests/fuzz_formats.py), fuzzed in a child
    whose address space is capped: an allocation sized by a file's claim fails the run, not this machine."""
    root = Path(__file__).resolve().parents[1]
    r = run_capped(f"import sys; sys.path.insert(0, {str(root)!r})\nfrom tests import fuzz_formats\n"
                   f"fuzz_formats.run({family!r})\n", cap_gib * GIB, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
