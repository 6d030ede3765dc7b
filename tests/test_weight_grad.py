"""Split backward: B leaves the linear layers' weight gradients for W, and B + W equals one whole backward."""
from __future__ import annotations

import pytest
import torch

from megatronapp.config import ModelConfig
from megatronapp.model.transformer import TransformerChunk
from megatronapp.parallel import weight_grad
from megatronapp.pipeline.schedules import check_orders, stage_orders, zb_h1_orders


def _chunk(family: str) -> TransformerChunk:
    cfg = ModelConfig(family=family, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16,
                      **({"num_kv_heads": 2} if family == "llama" else {}))
    return TransformerChunk(cfg, 0, 2, pre_process=True, post_process=True, seed=3)


def _grads(chunk: TransformerChunk) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _split_off():
    yield
    weight_grad.set_split(False)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_b_defers_linear_weights_and_w_completes_them(family):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    labels = torch.randint(0, 64, (2, 16))
    whole = _chunk(family)
    whole(ids, labels=labels).backward()
    want = _grads(whole)

    split = _chunk(family)
    weight_grad.set_split(True)
    loss = split(ids, labels=labels)
    with weight_grad.defer() as work:
        loss.backward()
    linear = {n for n, p in split.named_parameters()
              if any(q is p for d in work.items for q in d.weights + (d.biases or ()))}
    assert linear, "no linear layer deferred its weight gradient"
    after_b = _grads(split)
    shared = split.shared_embedding_weight()  # a tied embedding: its lookup gradient comes in B, its LM-head one in W
    tied = {n for n, p in split.named_parameters() if p is shared}
    for name in linear - tied:  # B left them alone...
        assert name not in after_b or torch.count_nonzero(after_b[name]) == 0, name
    for name in set(want) - linear:  # ...and did everything else (norms, embeddings)
        torch.testing.assert_close(after_b[name], want[name], msg=name)
    assert work.nbytes > 0
    weight_grad.run(work)
    got = _grads(split)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_split_forward_backpropagates_whole_outside_defer():
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 16))
    ref = _chunk("gpt2")
    ref(ids, labels=ids).backward()
    weight_grad.set_split(True)
    c = _chunk("gpt2")
    c(ids, labels=ids).backward()  # not inside defer(): everything at once
    for name, g in _grads(ref).items():
        torch.testing.assert_close(c.get_parameter(name).grad, g, atol=1e-6, rtol=1e-5, msg=name)


def test_w_accumulates_into_existing_gradient_buffers():
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (2, 16))
    ref = _chunk("llama")
    for _ in range(2):
        ref(ids, labels=ids).backward()
    c = _chunk("llama")
    weight_grad.set_split(True)
    for p in c.parameters():  # .grad as views of one flat buffer, as the DP reducer binds them
        p.grad = torch.zeros_like(p)
    for _ in range(2):
        loss = c(ids, labels=ids)
        with weight_grad.defer() as work:
            loss.backward()
        weight_grad.run(work)
    for name, g in _grads(ref).items():
        torch.testing.assert_close(c.get_parameter(name).grad, g, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (3, 7), (4, 8), (8, 3)])
def test_zb_h1_orders_are_complete_deadlock_free_and_hold_1f1b_peak(pp, m):
    orders = zb_h1_orders(pp, m)
    assert orders == stage_orders("zb-h1", pp, 1, m) and check_orders(orders, pp, 1, m)
    for order in orders:
        assert sorted(order) == sorted({t for t in order}) and len(order) == 3 * m
        held = peak = 0
        for t in order:
            held += {"F": 1, "B": 0, "W": -1}[t.kind]
            peak = max(peak, held)
        assert peak <= min(pp, m)


def test_check_orders_refuses_w_before_its_b():
    orders = zb_h1_orders(2, 2)
    bad = [list(o) for o in orders]
    i = next(k for k, t in enumerate(bad[1]) if t.kind == "W")
    w = bad[1].pop(i)
    bad[1].insert(0, w)
    assert not check_orders(bad, 2, 1, 2)
