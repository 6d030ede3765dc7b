"""Fuzzed inputs of the formats read from outside since the first fuzz round: Kineto traces, summary blocks,
Hugging Face configs and tokenizer files. Each property is run by `test_trust_fuzz.py` in a child process under an
address-space cap (RLIMIT_AS), so an allocation sized by a file's claim fails the run instead of taking the
machine: every input is accepted (within bounds) or gets its reader's own clear error, never another exception.
Not a test module itself: `run(name)` runs one family in the calling (capped) process."""
from __future__ import annotations

import gzip
import json
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))

big_ints = st.one_of(st.integers(-3, 8), st.integers(-2**70, 2**70), st.sampled_from([2**20, 2**20 + 1, 10**9]))
numbers = st.one_of(big_ints, st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e17, -1e17, 1.7e15]))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=20)


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="fuzz-"))


# -- Kineto traces ------------------------------------------------------------------------------------------------
NAMES = ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#" + "9" * 30, "aten::mm", "gloo:all_reduce",
         "nccl:all_gather", "ncclKernel_AllReduce_RING_LL_Sum_float", "Optimizer.step", "DataLoader next",
         "FSDP::all_gather", "c10d::allreduce_"]
ARGS = {"Seq": numbers, "In msg nelems": numbers, "dtype": scalars, "Process Group Name": scalars,
        "Process Group Ranks": st.one_of(json_values, st.lists(big_ints, max_size=4).map(json.dumps)),
        "Input Dims": json_values, "Input type": json_values, "Collective name": scalars}
events = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "X", "X", "i", "B"]), "name": st.one_of(st.sampled_from(NAMES), scalars),
     "ts": st.one_of(numbers, st.floats(0, 1e4)), "dur": st.one_of(numbers, st.floats(0, 1e3))},
    optional={"cat": st.sampled_from(["cpu_op", "user_annotation", "kernel", "gpu_memcpy", "python_function"]),
              "pid": scalars, "tid": scalars,
              "args": st.one_of(json_values, st.fixed_dictionaries({}, optional=ARGS))})
infos = st.fixed_dictionaries({"rank": big_ints, "world_size": big_ints},
                              optional={"backend": scalars, "pg_config": json_values})
good_infos = st.fixed_dictionaries({"rank": st.integers(0, 1), "world_size": st.just(2)}, optional={
    "pg_config": st.lists(st.fixed_dictionaries({"pg_name": st.sampled_from(["0", "1"]),
                                                 "ranks": st.lists(big_ints, max_size=3)}), max_size=2)})
# a well-formed step of a CPU trace, to which fuzzed events are added: most examples reach the mapping and the
# analysis instead of stopping at the first check
BASE = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 300},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2, "ts": 400, "dur": 100,
         "args": {"Process Group Name": "0", "Process Group Ranks": "[0, 1]", "In msg nelems": 16}}]
kineto_docs = st.one_of(
    st.fixed_dictionaries({"distributedInfo": st.one_of(good_infos, good_infos, good_infos, infos, json_values),
                           "traceEvents": st.lists(events, max_size=8).map(lambda ev: BASE + ev)}),
    st.fixed_dictionaries({"distributedInfo": st.one_of(infos, json_values),
                           "traceEvents": st.lists(events, max_size=12)}),
    json_values)


@FUZZ
@given(docs=st.lists(st.tuples(kineto_docs, st.booleans()), min_size=1, max_size=3))
def kineto_traces(docs):
    from megatronapp.scan.detect.table import join, phases
    from megatronapp.scan.read import format as fmt
    from megatronapp.scan.read.traces import read_traces

    d = _tmp()
    for i, (doc, gz) in enumerate(docs):
        text = json.dumps(doc, allow_nan=True).encode()
        (d / f"r{i}.json{'.gz' if gz else ''}").write_bytes(gzip.compress(text) if gz else text)
    traces, problems = read_traces(d)
    assert all(isinstance(p, str) and len(p) < 2000 for p in problems)
    for t in traces:
        assert 0 <= t.rank < t.world <= fmt.MAX_WORLD
    if traces:
        phases(join(traces))  # what every view starts from: sized within bounds


# -- summary blocks -----------------------------------------------------------------------------------------------
VALID_INTS = [0, 2, 0, 0, 0, 1, 1, 2, -1, 0, 5, 0]  # rank 0 of 2, coord (0, 0, 0), topo (1, 1, 2), 5 spans
VALID_HEADER = {"rank": 0, "world": 2, "coord": [0, 0, 0], "topo": [1, 1, 2]}
times = st.one_of(st.floats(0, 1e3), st.just(float("nan")), st.floats(allow_nan=True, allow_infinity=True))
shaped = st.integers(0, 3).flatmap(lambda w: st.tuples(
    st.just(w), st.one_of(st.lists(st.integers(0, 9), min_size=w, max_size=w, unique=True).map(sorted),
                          st.lists(big_ints, min_size=w, max_size=w)),
    st.lists(times, min_size=2 * w + 7, max_size=2 * w + 7)))
unshaped = st.tuples(st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)), st.lists(big_ints, max_size=4),
                     st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=20))


@FUZZ
@given(parts=st.one_of(shaped, shaped, unshaped),
       ints=st.one_of(st.just(VALID_INTS), st.lists(big_ints, min_size=12, max_size=12)),
       header=st.one_of(st.just(VALID_HEADER), st.fixed_dictionaries(
           {"rank": big_ints, "world": big_ints, "coord": json_values, "topo": json_values})),
       trailer=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def summary_blocks(parts, ints, header, trailer):
    from megatronapp.scan.detect.features import features
    from megatronapp.scan.read import format as fmt
    from megatronapp.scan.read import rank_summary

    W, iters, floats = parts
    clip = [max(-2**63, min(2**63 - 1, x)) for x in ints + iters]
    body = struct.pack("<4sI", b"RS01", W) + struct.pack(f"<{len(clip)}q", *clip) + \
        struct.pack(f"<{len(floats)}d", *floats)
    payload = body + struct.pack("<I4s", len(body) + 8 if trailer is None else trailer, b"SUMS")
    got = rank_summary.decode(payload)
    assert isinstance(got, str) or fmt.cells_problem(got["world"], len(got["iters"])) is None
    d = _tmp()
    head = json.dumps(header, allow_nan=True).encode()
    block = fmt._BLOCK.pack(b"SUMS", len(payload), zlib.crc32(payload)) + payload
    (d / "rank00000.mst").write_bytes(fmt.MAGIC + fmt._BLOCK.pack(b"HEAD", len(head), zlib.crc32(head)) + head
                                      + block)
    summary, why = rank_summary.read(str(d / "rank00000.mst"))
    assert summary is None or why is None
    try:
        f = features(d, workers=1)
    except ValueError as e:  # no readable rank file: the message names the problems
        assert "rank00000.mst" in str(e)
        return
    assert f.work.size <= fmt.MAX_CELLS


# -- Hugging Face configs -----------------------------------------------------------------------------------------
GPT2_KEYS = ["n_embd", "n_layer", "n_head", "n_inner", "n_positions", "vocab_size", "layer_norm_epsilon",
             "tie_word_embeddings", "activation_function", "scale_attn_weights", "add_cross_attention"]
LLAMA_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
              "rope_parameters", "attention_bias", "mlp_bias", "hidden_act", "vocab_size"]
GOOD = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 64}


def _weights(d: Path) -> None:
    """A tiny GPT-2's tensors (2 layers, hidden 32, vocab 64) as model.safetensors."""
    import torch
    from safetensors.torch import save_file

    h, t = 32, {"transformer.wte.weight": (64, 32), "transformer.wpe.weight": (32, 32),
                "transformer.ln_f.weight": (32,), "transformer.ln_f.bias": (32,)}
    for i in range(2):
        for name, shape in (("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("ln_2.weight", (h,)), ("ln_2.bias", (h,)),
                            ("attn.c_attn.weight", (h, 3 * h)), ("attn.c_attn.bias", (3 * h,)),
                            ("attn.c_proj.weight", (h, h)), ("attn.c_proj.bias", (h,)),
                            ("mlp.c_fc.weight", (h, 4 * h)), ("mlp.c_fc.bias", (4 * h,)),
                            ("mlp.c_proj.weight", (4 * h, h)), ("mlp.c_proj.bias", (h,))):
            t[f"transformer.h.{i}.{name}"] = shape
    save_file({k: torch.zeros(s) for k, s in t.items()}, str(d / "model.safetensors"))


_WEIGHTS: list[Path] = []


@FUZZ
@given(raw=st.one_of(
    st.fixed_dictionaries({"model_type": st.just("gpt2")}, optional={k: st.one_of(scalars, st.just(GOOD.get(k, 1)))
                                                                     for k in GPT2_KEYS}),
    st.fixed_dictionaries({"model_type": st.just("llama")}, optional={k: st.one_of(json_values, big_ints)
                                                                      for k in LLAMA_KEYS}),
    st.dictionaries(st.sampled_from(GPT2_KEYS), scalars).map(lambda d: {**GOOD, **d}),
    json_values))
def hf_configs(raw):
    from megatronapp.config import validate_model
    from megatronapp.model.hf import HFCheckpointError, check_tensors, config_from_hf

    if not _WEIGHTS:
        _WEIGHTS.append(_tmp())
        _weights(_WEIGHTS[0])
    d = _WEIGHTS[0]
    (d / "config.json").write_text(json.dumps(raw, allow_nan=True))
    try:
        cfg = config_from_hf(d)
        validate_model(cfg)
        check_tensors(d, cfg)  # a model the tensors do not hold is refused here, before anything is built
    except HFCheckpointError as e:
        assert "config.json" in str(e) or str(d) in str(e)
        assert len(str(e)) < 2000


# -- tokenizer files ----------------------------------------------------------------------------------------------
tok_docs = st.one_of(
    json_values,
    st.fixed_dictionaries({"version": st.one_of(st.just("1.0"), scalars)},
                          optional={"model": st.one_of(json_values, st.fixed_dictionaries(
                              {"type": st.sampled_from(["BPE", "WordLevel", "Unigram", "X"])},
                              optional={"vocab": json_values, "merges": json_values, "unk_token": scalars})),
                              "added_tokens": json_values, "pre_tokenizer": json_values, "normalizer": json_values,
                              "decoder": json_values, "post_processor": json_values}))


@FUZZ
@given(doc=st.one_of(tok_docs.map(lambda d: json.dumps(d, allow_nan=True).encode()), st.binary(max_size=200)))
def tokenizer_files(doc):
    from megatronapp.data.tokenizer import HFTokenizer

    d = _tmp()
    (d / "tokenizer.json").write_bytes(doc)
    try:
        tok = HFTokenizer(d)
    except ValueError as e:
        assert len(str(e)) < 1000
        return
    assert tok.vocab_size >= 0 and isinstance(tok.to_json(), str)


FAMILIES = {"kineto": kineto_traces, "summary": summary_blocks, "hf_config": hf_configs, "tokenizer": tokenizer_files}


def run(name: str) -> None:
    """Run one family's property (in the calling process: the test caps it first)."""
    np.seterr(all="ignore")  # a NaN in a fuzzed summary may warn in a median; a warning is not a failure
    FAMILIES[name]()
