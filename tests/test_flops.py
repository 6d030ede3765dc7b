"""The one FLOP model (flops.py) and its three users: MFU (`ModelConfig`), emulated devices and MegaScan's stage
costs count the same layer the same way, exactly (every count is an integer-valued float below 2**53)."""
from __future__ import annotations

import pytest

from megatronapp import flops
from megatronapp.config import PRESETS, ModelConfig, RunConfig
from megatronapp.parallel import device_emulation as emu
from megatronapp.scan.record import costmodel
from tests import engine_cases as ec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_model_config_and_the_scan_cost_model_count_with_flops(name):
    m = ModelConfig(**PRESETS[name])
    seq = min(m.max_seq_len, 512)
    f, b, w, core = flops.layer_flops(m, seq)
    assert (f - core, b - 2 * core) == (w, w) == (2 * flops.layer_weights(m),) * 2  # 2 FLOPs per weight per pass
    assert m.flops_per_token(seq) == m.num_layers * (f + b + w) + 6 * m.hidden_size * m.vocab_size
    assert m.num_params() - m.num_layers * flops.layer_weights(m) == \
        m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2) + (m.max_seq_len * m.hidden_size
                                                                         if m.family == "gpt2" else 0)
    # scan's stage cost of a middle chunk is the layers' F + B + W, nothing more
    assert costmodel.chunk_flops_per_token(m, seq, 3, False, False) == 3 * (f + b + w)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_emulated_tasks_of_a_step_are_the_model_flops_exactly(family):
    cfg = RunConfig.from_dict(ec.base_case(family, **{"parallel.pp": 2, "parallel.vpp": 2,
                                                      "parallel.schedule": "interleaved-1f1b"}))
    per_microbatch = sum(f + b + w for f, b, w in emu.virtual_flops(cfg))
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    assert per_microbatch * cfg.parallel.microbatches == cfg.model.flops_per_token(cfg.train.seq_len) * tokens
