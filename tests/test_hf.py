"""Hugging Face checkpoints: tiny random GPT-2 and Llama (GQA) saved locally load into our model exactly.

transformers is imported only inside the fixture, so the spawned ranks (which import this module) stay light.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatronapp.launch import spawn
from megatronapp.model.hf import HFCheckpointError, config_from_hf, load_hf_weights
from megatronapp.model.transformer import TransformerChunk, build_model
from megatronapp.parallel import topology

ATOL = 1e-4
VOCAB = 64



def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """gpt2/ (one safetensors file, tied) and llama/ (GQA, untied, sharded with an index) plus reference logits."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    models = {
        "gpt2": (GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=32,
                                            bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
                 "5GB"),
        "llama": (LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                               max_position_embeddings=64, rope_theta=500.0,
                                               tie_word_embeddings=False, attn_implementation="eager")),
                  "20KB"),
    }
    refs = {}
    for name, (model, shard_size) in models.items():
        with torch.no_grad():
            # HF initialises norms to 1 and biases to 0; random values make every tensor's mapping matter.
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        model.eval()
        model.save_pretrained(root / name, max_shard_size=shard_size)
        with torch.no_grad():
            refs[name] = model(_ids()).logits
    torch.save(refs, root / "ref.pt")
    assert (root / "llama" / "model.safetensors.index.json").is_file()  # the sharded path is exercised
    assert (root / "gpt2" / "model.safetensors").is_file()
    return root


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_config_from_hf(checkpoints, name):
    cfg = config_from_hf(checkpoints / name)
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (name, 64, 32, 3, 4)
    if name == "llama":
        assert (cfg.num_kv_heads, cfg.ffn_hidden_size, cfg.rope_theta, cfg.tie_embeddings) == (2, 48, 500.0, False)
    else:
        assert (cfg.ffn_hidden_size, cfg.max_seq_len, cfg.bias, cfg.tie_embeddings) == (128, 32, True, True)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_logits_match_hf(checkpoints, name):
    ref = torch.load(checkpoints / "ref.pt")[name]
    model = build_model(config_from_hf(checkpoints / name))
    load_hf_weights(model, checkpoints / name)
    with torch.no_grad():
        got = model(_ids())
    assert (got - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_two_chunk_pipeline_split_matches_hf(checkpoints, name):
    ref = torch.load(checkpoints / "ref.pt")[name]
    cfg = config_from_hf(checkpoints / name)
    first = TransformerChunk(cfg, 0, 1, pre_process=True, post_process=False)
    last = TransformerChunk(cfg, 1, 3, pre_process=False, post_process=True)
    for chunk in (first, last):
        load_hf_weights(chunk, checkpoints / name)
    with torch.no_grad():
        got = last(first(_ids()))
    assert (got - ref).abs().max().item() <= ATOL


def _tp_worker(rank: int, world: int, root: str) -> None:
    root_path = Path(root)
    refs = torch.load(root_path / "ref.pt")
    group = topology.build(tp=world, pp=1, dp=1).tp_group
    for name in ("gpt2", "llama"):
        path = root_path / name
        cfg = config_from_hf(path)
        whole = TransformerChunk(cfg, 0, cfg.num_layers, True, True, tp_group=group)
        load_hf_weights(whole, path)
        # tp=2 with sequence parallelism and a 2-chunk pipeline split at once.
        kw = {"tp_group": group, "sequence_parallel": True}
        first = TransformerChunk(cfg, 0, 2, True, False, **kw)
        last = TransformerChunk(cfg, 2, 3, False, True, **kw)
        for chunk in (first, last):
            load_hf_weights(chunk, path)
        with torch.no_grad():
            for what, got in (("tp=2", whole(_ids())), ("tp=2 sp pp=2", last(first(_ids())))):
                err = (got - refs[name]).abs().max().item()
                assert err <= ATOL, f"{name} {what}: max abs diff {err}"


def test_tp2_split_matches_hf(checkpoints):
    spawn(_tp_worker, 2, str(checkpoints))


def test_clear_errors_name_the_file(checkpoints, tmp_path):
    with pytest.raises(HFCheckpointError, match="not a directory"):
        config_from_hf(tmp_path / "nowhere")
    with pytest.raises(HFCheckpointError, match="config.json"):
        config_from_hf(tmp_path)

    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((checkpoints / "gpt2" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "model_type": "bert"}))
    with pytest.raises(HFCheckpointError, match="model_type='bert'"):
        config_from_hf(bad)
    (bad / "config.json").write_text(json.dumps({**raw, "activation_function": "relu"}))
    with pytest.raises(HFCheckpointError, match="activation_function"):
        config_from_hf(bad)

    (bad / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(bad)
    model = build_model(cfg)
    with pytest.raises(HFCheckpointError, match="no model.safetensors"):
        load_hf_weights(model, bad)
    (bad / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(HFCheckpointError, match="safe_serialization"):
        load_hf_weights(model, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header")
    with pytest.raises(HFCheckpointError, match=r"bad[/\\]model.safetensors: corrupt"):
        load_hf_weights(model, bad)

    from safetensors.torch import save_file

    save_file({"transformer.wte.weight": torch.zeros(VOCAB, 32)}, str(bad / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="'transformer.wpe.weight' is missing"):
        load_hf_weights(model, bad)

    wrong = build_model(config_from_hf(checkpoints / "llama"))
    with pytest.raises(HFCheckpointError, match="model.family='llama'"):
        load_hf_weights(wrong, checkpoints / "gpt2")
