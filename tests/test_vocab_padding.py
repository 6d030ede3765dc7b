"""Vocabulary padding for tensor parallelism (Megatron-LM's make_vocab_size_divisible_by): a real GPT-2
vocabulary (50257) splits any tp ways, padding never counts in the loss, is never sampled, and never leaves the
model (logits, consolidated checkpoints).

transformers is imported only inside the fixture, so the spawned ranks (which import this module) stay light.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatronapp.config import ConfigError, ModelConfig, RunConfig, validate
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.launch import spawn
from megatronapp.model.transformer import (
    TransformerChunk,
    build_model,
    load_unpadded_state_dict,
    unpadded_state_dict,
)
from megatronapp.parallel import comm, tensor_parallel, topology
from megatronapp.parallel.tensor_parallel import mask_vocab_padding, shard, vocab_parallel_cross_entropy
from megatronapp.scope.generate import ScopeModel, generate, logit_lens
from megatronapp.scope.protocol import Generate

GPT2_VOCAB = 50257
ATOL = 1e-4


# ---------------------------------------------------------------- arithmetic (no processes)
@pytest.mark.parametrize("tp, padded", [(1, 50304), (2, 50432), (4, 50688), (8, 51200)])
def test_padded_vocab_size_is_megatrons(tp, padded):
    cfg = ModelConfig(vocab_size=GPT2_VOCAB)
    assert cfg.padded_vocab_size(tp) == padded
    # the smallest multiple of 128 * tp that holds the vocabulary: equal TP slices, each a multiple of 128
    assert padded % (128 * tp) == 0 and 0 <= padded - GPT2_VOCAB < 128 * tp
    assert (padded // tp) % 128 == 0
    # 1 pads only to a multiple of tp (no padding when tp divides the vocabulary)
    assert ModelConfig(vocab_size=GPT2_VOCAB, make_vocab_size_divisible_by=1).padded_vocab_size(tp) == \
        -(-GPT2_VOCAB // tp) * tp
    assert ModelConfig(vocab_size=256).padded_vocab_size(tp) == max(256, 128 * tp)


def test_config_accepts_any_vocab_and_names_the_padding_field():
    for tp in (2, 4, 8):
        cfg = RunConfig.from_dict({"model": {"vocab_size": GPT2_VOCAB, "num_heads": 8},
                                   "parallel": {"tp": tp}})
        validate(cfg, world_size=tp)  # 50257 is prime to every tp > 1: padding makes it splittable
    with pytest.raises(ConfigError, match="model.make_vocab_size_divisible_by=0"):
        ModelConfig(make_vocab_size_divisible_by=0)


@pytest.mark.parametrize("tp, vocab", [(4, GPT2_VOCAB), (8, GPT2_VOCAB), (8, 300)])
def test_shards_and_masks_at_tp4_and_tp8(monkeypatch, tp, vocab):
    # Each rank's slice of the real-vocabulary tensor, and its padding mask, from tp_rank alone.
    cfg = ModelConfig(vocab_size=vocab, hidden_size=2)
    local = cfg.padded_vocab_size(tp) // tp
    full = torch.arange(1.0, vocab + 1).unsqueeze(1).expand(vocab, 2)  # row i holds i + 1: no zero real row
    p = tensor_parallel.mark_vocab_parallel(torch.nn.Parameter(torch.empty(local, 2)), vocab)
    group = topology.Group("tp", tuple(range(tp)), None)
    pieces, masks = [], []
    for rank in range(tp):
        monkeypatch.setattr(tensor_parallel, "tp_rank", lambda g, r=rank: r)
        pieces.append(shard(full, p, group))
        masks.append(torch.isinf(mask_vocab_padding(torch.zeros(1, local), vocab, group))[0])
    stitched, padding = torch.cat(pieces), torch.cat(masks)
    assert stitched.shape == (cfg.padded_vocab_size(tp), 2)
    assert torch.equal(stitched[:vocab], full) and not stitched[vocab:].any()
    assert torch.equal(padding, torch.arange(cfg.padded_vocab_size(tp)) >= vocab)
    if vocab == 300:  # 1024 rows over 8 ranks of 128: ranks 3..7 hold only padding
        assert all(m.all() for m in masks[3:]) and not masks[0].any()


def test_single_process_pads_too_and_padding_rows_stay_zero():
    # tp=1 pads to a multiple of 128 as Megatron does; the real rows are the unpadded model's, padding is zero.
    cfg = ModelConfig(vocab_size=200, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=16,
                      tie_embeddings=False)
    model = build_model(cfg, seed=1)
    unpadded = build_model(ModelConfig(**{**cfg.__dict__, "vocab_size": 256}), seed=1)  # 256: no padding
    for w in (model.embedding.word.weight, model.output.weight):
        assert w.shape == (256, 32) and not w[200:].any()
    # the same seeds give the same real rows whatever the padding (split-independent initialisation)
    assert torch.equal(model.layers["0"].attn.qkv.weight, unpadded.layers["0"].attn.qkv.weight)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 200, (2, 8), generator=g), torch.randint(0, 200, (2, 8), generator=g)
    model(ids, labels=labels).backward()
    for w in (model.embedding.word.weight, model.output.weight):
        assert w.grad[:200].any() and not w.grad[200:].any()  # padding rows get no gradient
    assert model(ids).shape == (2, 8, 200)  # logits of the real vocabulary only


def test_exported_weights_drop_padding_and_load_back():
    cfg = ModelConfig(vocab_size=200, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=16)
    model = build_model(cfg, seed=4)
    state = unpadded_state_dict(model)
    assert state["embedding.word.weight"].shape == (200, 32)  # what a consolidated checkpoint holds
    other = build_model(cfg, seed=5)
    load_unpadded_state_dict(other, state)
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(KeyError, match="missing"):
        load_unpadded_state_dict(other, {k: v for k, v in state.items() if k != "final_norm.weight"})


# ---------------------------------------------------------------- loss and sampling
def _padded_logits(vocab: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [2, 5, width] whose padding columns are large, so any padding that leaks into the loss shows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, width, generator=g)
    logits[..., vocab:] = 30.0
    return logits, torch.randint(0, vocab, (2, 5), generator=g)


def _check_loss(vocab: int, width: int, group, rank: int, tp: int) -> None:
    full, labels = _padded_logits(vocab, width)
    ref_in = full[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.flatten(0, 1), labels.flatten(), reduction="none").view(2, 5)
    ref.sum().backward()
    local = full.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, group, vocab_size=vocab)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    loss.sum().backward()
    grad = comm.all_gather(local.grad, group, dim=-1) if tp > 1 else local.grad
    torch.testing.assert_close(grad[..., :vocab], ref_in.grad, atol=1e-6, rtol=0)
    assert not grad[..., vocab:].any()  # padding logits get no gradient


def test_loss_with_padding_equals_loss_on_unpadded_logits():
    _check_loss(vocab=100, width=128, group=None, rank=0, tp=1)
    # the padding logits (30) would dominate an unmasked loss: the check above can fail
    full, labels = _padded_logits(100, 128)
    masked = vocab_parallel_cross_entropy(full, labels, None, vocab_size=100)
    assert (vocab_parallel_cross_entropy(full, labels, None) - masked).min() > 20


def _sampling_model(cfg: ModelConfig, group=None) -> TransformerChunk:
    """A model whose padding rows of the (tied) output weight are huge: unmasked, padding would win every step."""
    model = TransformerChunk(cfg, 0, cfg.num_layers, True, True, tp_group=group, seed=2).eval()
    w = model.output_weight()
    local = w.shape[0]
    start = tensor_parallel.tp_rank(group) * local
    with torch.no_grad():
        for i in range(max(cfg.vocab_size - start, 0), local):
            w[i] = 5.0 * torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(start + i))
    return model


def _check_never_sampled(cfg: ModelConfig, group) -> None:
    model = _sampling_model(cfg, group)
    lens_weight = None
    if group is not None:
        lens_weight = comm.all_gather(model.output_weight().detach(), group, dim=0)
    sm = ScopeModel(model, cfg, ByteTokenizer(), lens_weight=lens_weight)
    ids = torch.tensor([[72, 105, 33, 10]])
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (1, 4, cfg.vocab_size) and torch.isfinite(logits).all()
        hidden = torch.randn(1, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        lens_ids, _ = logit_lens(model, hidden, lens_weight)
        assert (lens_ids < cfg.vocab_size).all()
    for greedy, top_k in ((True, 0), (False, 0), (False, 5)):
        msgs: list[dict] = []
        req = Generate(type="generate", prompts=["Hi", "ok?"], max_new_tokens=12, greedy=greedy, top_k=top_k,
                       temperature=5.0, seed=1, capture={"points": ["logits"], "logit_lens": True})
        generate(sm, req, msgs.append)
        steps = [m for m in msgs if m["type"] == "step"]
        assert steps and all(m["states"]["logits"]["orig_shape"][-1] == cfg.vocab_size for m in steps)
        for m in steps:
            for row in m.get("next", []):
                assert row["id"] < cfg.vocab_size, f"padding id {row['id']} sampled (greedy={greedy})"


def test_padded_logits_are_never_sampled():
    # vocab 200 pads to 256 at tp=1: ids 200..255 exist in the weights but must never come out
    cfg = ModelConfig(vocab_size=200, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)
    _check_never_sampled(cfg, None)


# ---------------------------------------------------------------- two real ranks
@pytest.fixture(scope="module")
def gpt2_full_vocab(tmp_path_factory) -> Path:
    """A randomly initialised GPT-2 with the real 50257-token vocabulary, saved as safetensors, with reference
    logits from transformers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("gpt2-50257")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=GPT2_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                       attn_implementation="eager"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # every tensor random, so every mapping matters
    model.eval()
    model.save_pretrained(root / "gpt2", safe_serialization=True)
    assert (root / "gpt2" / "model.safetensors").is_file()
    with torch.no_grad():
        torch.save(model(_hf_ids()).logits, root / "ref.pt")
    return root


def _hf_ids() -> torch.Tensor:
    # ids near the end of the vocabulary too: they live on the last TP rank, next to the padding
    ids = torch.randint(0, GPT2_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[0, :3] = torch.tensor([GPT2_VOCAB - 1, GPT2_VOCAB - 2, 0])
    return ids


def _worker(rank: int, world: int, root: str) -> None:
    from megatronapp.model.hf import config_from_hf, load_hf_weights

    group = topology.build(tp=world, pp=1, dp=1).tp_group
    # loss: a shard with some padding (vocab 100), and one wholly padding (vocab 50: rank 1 holds ids 64..127)
    for vocab in (100, 50):
        _check_loss(vocab, 128, group, rank, world)
    _check_never_sampled(ModelConfig(vocab_size=200, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32),
                         group)
    # Hugging Face parity with the full GPT-2 vocabulary, split over 2 ranks of 50432 / 2 rows
    path = Path(root) / "gpt2"
    cfg = config_from_hf(path)
    model = TransformerChunk(cfg, 0, cfg.num_layers, True, True, tp_group=group)
    load_hf_weights(model, path)
    w = model.embedding.word.weight
    assert w.shape == (cfg.padded_vocab_size(2) // 2, 64)
    if rank == 1:
        real = GPT2_VOCAB - w.shape[0]
        assert w[:real].abs().sum() > 0 and not w[real:].any()  # HF fills real rows, padding stays zero
    with torch.no_grad():
        got = model(_hf_ids())
    ref = torch.load(Path(root) / "ref.pt")
    assert got.shape == ref.shape == (2, 12, GPT2_VOCAB)
    err = (got - ref).abs().max().item()
    assert err <= ATOL, f"tp=2 max abs diff {err}"


def test_tp2_loss_sampling_and_hf_parity_with_full_gpt2_vocab(gpt2_full_vocab):
    spawn(_worker, 2, str(gpt2_full_vocab))


def test_full_gpt2_vocab_single_process_hf_parity(gpt2_full_vocab):
    from megatronapp.model.hf import config_from_hf, load_hf_weights

    cfg = config_from_hf(gpt2_full_vocab / "gpt2")
    model = build_model(cfg)
    load_hf_weights(model, gpt2_full_vocab / "gpt2")
    assert model.embedding.word.weight.shape == (50304, 64) and not model.embedding.word.weight[GPT2_VOCAB:].any()
    with torch.no_grad():
        got = model(_hf_ids())
    assert (got - torch.load(gpt2_full_vocab / "ref.pt")).abs().max().item() <= ATOL


@pytest.mark.slow
def test_gpt2_vocab_trains_at_tp2_from_the_cli_and_serves(tmp_path):
    from megatronapp.cli import main
    from megatronapp.train.consolidate import consolidate, load_model

    out = tmp_path / "run"
    code = main(["train", "--nproc", "2", "--tp", "2", "--vocab", str(GPT2_VOCAB), "--hidden", "32",
                 "--layers", "2", "--heads", "2", "--steps", "2", "--global-batch", "2", "--seq-len", "16",
                 "--no-progress", "--peak-tflops", "1", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    # the checkpoint holds 50432 padded rows over 2 ranks; consolidation gives the real vocabulary back
    cfg, state = consolidate(out / "checkpoints" / "latest")
    assert cfg.vocab_size == GPT2_VOCAB and state["embedding.word.weight"].shape == (GPT2_VOCAB, 32)
    model = load_model(out / "checkpoints" / "latest").eval()
    assert model.embedding.word.weight.shape == (50304, 32)  # this one-process model's own padding
    assert torch.equal(model.embedding.word.weight[:GPT2_VOCAB], state["embedding.word.weight"])
    msgs: list[dict] = []
    generate(ScopeModel(model, cfg, ByteTokenizer()),
             Generate(type="generate", prompts=["The"], max_new_tokens=4, seed=3), msgs.append)
    ids = [row["id"] for m in msgs if m["type"] == "step" for row in m.get("next", [])]
    assert ids and all(0 <= i < GPT2_VOCAB for i in ids)


@pytest.mark.slow
def test_trainer_with_padded_vocab_matches_single_process(tmp_path):
    # vocab 300 with make_vocab_size_divisible_by=160 pads to 320 at tp=1 and at tp=2 (rank 1 holds ids 160..319,
    # twenty of them padding), so the engine's harness compares whole tensors: two optimizer steps with weight
    # decay and global-norm clipping train exactly like one process, and the padding rows stay zero.
    from tests import engine_cases as ec

    vocab = {"model.vocab_size": 300, "model.make_vocab_size_divisible_by": 160, "parallel.tp": 2,
             "model.num_layers": 2}
    cases = [ec.base_case("gpt2", **vocab, **{"train.grad_clip": 1.0, "train.weight_decay": 0.1}),
             ec.base_case("llama", **vocab, **{"parallel.sequence_parallel": True})]
    spawn(ec.worker, 2, cases, str(tmp_path))
    for i, case in enumerate(cases):
        results = [torch.load(tmp_path / f"case{i}_rank{r}.pt", weights_only=False) for r in range(2)]
        ec.compare(results, ec.reference(case), f"vocab 300 case {i}")
        params = ec.stitch(results, "params")
        for name in ("embedding.word.weight", "output.weight"):
            if name in params:
                assert params[name].shape[0] == 320 and not params[name][300:].any(), name
