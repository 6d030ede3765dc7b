"""Tensor parallelism: mappings, parallel layers and whole models on 2 real gloo ranks against one process."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatronapp.config import ModelConfig
from megatronapp.launch import spawn
from megatronapp.parallel import comm, topology, weight_grad
from megatronapp.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)

ATOL = 1e-5



def _configs() -> dict[str, ModelConfig]:
    return {
        "gpt2": ModelConfig(family="gpt2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16),
        "llama-gqa": ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                 num_kv_heads=2, ffn_hidden_size=48, max_seq_len=16),
        "gpt2-parallel-block": ModelConfig(family="gpt2", vocab_size=64, hidden_size=32, num_layers=2,
                                           num_heads=4, max_seq_len=16, parallel_block=True, sliding_window=5),
    }


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    labels = torch.randint(0, 64, (2, 8), generator=g)
    return ids, labels


def _full(t: torch.Tensor, p: torch.nn.Parameter, group) -> torch.Tensor:
    """The unsharded value of a (possibly TP-sharded) tensor."""
    if getattr(p, "tensor_parallel", False):
        return comm.all_gather(t.contiguous(), group, dim=p.partition_dim)
    return t


def _real(t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """The real-vocabulary rows of a full vocab-padded tensor (whose padding differs between tp=1 and tp=2),
    after checking its padding rows are zero: zero weights stay zero because they get zero gradients."""
    vocab = getattr(p, "vocab_size", None)
    if vocab is None:
        return t
    assert not t[vocab:].any(), "vocabulary padding rows must be zero"
    return t[:vocab]


def _check_mappings(group, rank: int) -> None:
    # Forward values and the conjugate backward of every mapping, on rank-dependent inputs.
    x = torch.arange(12.0).view(1, 4, 3) + 100 * rank
    x.requires_grad_(True)
    y = reduce_from_tp(x, group)
    assert torch.equal(y, 2 * torch.arange(12.0).view(1, 4, 3) + 100)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones_like(x))  # identity backward

    x.grad = None
    y = copy_to_tp(x, group)
    assert torch.equal(y, x)
    y.backward(torch.full_like(y, float(rank + 1)))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))  # all-reduced gradient

    x.grad = None
    y = gather_from_tp(x, group, dim=-1)
    assert y.shape == (1, 4, 6) and torch.equal(y[..., 3 * rank:3 * rank + 3], x)
    y.backward(torch.arange(24.0).view(1, 4, 6))
    assert torch.equal(x.grad, torch.arange(24.0).view(1, 4, 6)[..., 3 * rank:3 * rank + 3])

    x.grad = None
    y = scatter_to_tp(x, group, dim=1)
    assert torch.equal(y, x[:, 2 * rank:2 * rank + 2])
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones_like(x))  # gathered from both ranks

    x.grad = None
    y = gather_from_sp(x, group)
    assert y.shape == (1, 8, 3)
    y.backward(torch.ones_like(y) * (rank + 1))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))  # reduce-scattered

    x.grad = None
    y = reduce_scatter_to_sp(x, group)
    full_sum = 2 * torch.arange(12.0).view(1, 4, 3) + 100
    assert torch.equal(y, full_sum[:, 2 * rank:2 * rank + 2])
    y.backward(torch.full_like(y, float(rank + 1)))
    assert torch.equal(x.grad[:, :2], torch.full((1, 2, 3), 1.0))
    assert torch.equal(x.grad[:, 2:], torch.full((1, 2, 3), 2.0))


def _check_layers(group, rank: int, sequence_parallel: bool) -> None:
    # Column -> row parallel MLP and the vocab-parallel embedding and loss against plain torch.
    g = torch.Generator().manual_seed(7)
    w1, w2, b2 = torch.randn(12, 6, generator=g), torch.randn(6, 12, generator=g), torch.randn(6, generator=g)
    emb = torch.randn(10, 6, generator=g)
    ids = torch.randint(0, 10, (2, 4), generator=g)
    labels = torch.randint(0, 10, (2, 4), generator=g)
    ref_params = [t.clone().requires_grad_(True) for t in (w1, w2, b2, emb)]
    rw1, rw2, rb2, remb = ref_params
    x_ref = F.embedding(ids, remb)
    ref_logits = F.linear(F.linear(torch.tanh(F.linear(x_ref, rw1)), rw2, rb2), remb)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 4)
    ref_loss.sum().backward()

    col = ColumnParallelLinear(6, 12, bias=False, tp_group=group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(12, 6, bias=True, tp_group=group, sequence_parallel=sequence_parallel)
    vemb = VocabParallelEmbedding(10, 6, tp_group=group, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(2, 0)[rank])
        row.weight.copy_(w2.chunk(2, 1)[rank])
        row.bias.copy_(b2)
        vemb.weight.copy_(emb.chunk(2, 0)[rank])
    h = row(torch.tanh(col(vemb(ids))))
    assert h.shape == ((2, 2, 6) if sequence_parallel else (2, 4, 6))
    h = gather_from_sp(h, group) if sequence_parallel else copy_to_tp(h, group)
    local_logits = F.linear(h, vemb.weight)
    loss = vocab_parallel_cross_entropy(local_logits, labels, group)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    loss.sum().backward()
    sync_sequence_parallel_grads(row, group)
    for ours, ref in ((col.weight, rw1), (row.weight, rw2), (row.bias, rb2), (vemb.weight, remb)):
        torch.testing.assert_close(_full(ours.grad, ours, group), ref.grad, atol=ATOL, rtol=0)


def _check_overlap(group, rank: int) -> None:
    # Chunked collectives overlapped with the GEMMs (tp_overlap.py) against the plain layers: outputs, input
    # gradients and weight gradients, immediate and deferred to a W task; and two column-parallel layers run as
    # one GEMM (fused SwiGLU) against the two run apart.
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(2, 4, 6, generator=g)  # this rank's sequence slice: [b, s/tp, h]
    gy = torch.randn(2, 8, 10, generator=g)
    gz = torch.randn(2, 4, 6, generator=g)
    w = torch.Generator().manual_seed(5)
    weights = [torch.randn(*shape, generator=w) for shape in ((10, 6), (10, 6), (6, 20), (10,), (10,), (6,))]

    def run(chunks: int, fused: bool, split: bool):
        kw = {"tp_group": group, "sequence_parallel": True, "tp_comm_overlap": chunks}
        gate, up = ColumnParallelLinear(6, 10, **kw), ColumnParallelLinear(6, 10, **kw)
        row = RowParallelLinear(20, 6, **kw)
        with torch.no_grad():
            for p, full in zip((gate.weight, up.weight, row.weight, gate.bias, up.bias, row.bias), weights):
                p.copy_(full.chunk(2, dim=getattr(p, "partition_dim", 0))[rank] if p is not row.bias else full)
        xi = x.clone().requires_grad_(True)
        weight_grad.set_split(split)
        try:
            y = column_parallel_linear(xi, (gate, up)) if fused else torch.cat([gate(xi), up(xi)], dim=-1)
            z = row(y.tanh())
            with weight_grad.defer() if split else contextlib.nullcontext() as work:
                torch.autograd.backward([y, z], [gy, gz])
            if split:
                assert work.items, "no weight gradient was deferred"
                weight_grad.run(work)
        finally:
            weight_grad.set_split(False)
        return [y, z, xi.grad] + [p.grad for p in (gate.weight, up.weight, row.weight, gate.bias, up.bias)]

    # Fused: one sequence all-gather for gate and up together; apart: one each.
    gathers: list[str] = []

    def seen(op: comm.CommOp) -> None:
        gathers.append(op.name)

    comm.add_interceptor(seen)
    try:
        layers = [ColumnParallelLinear(6, 10, tp_group=group, sequence_parallel=True) for _ in range(2)]
        column_parallel_linear(x, tuple(layers))
        fused, gathers[:] = gathers.count("all_gather"), []
        layers[0](x), layers[1](x)
        assert (fused, gathers.count("all_gather")) == (1, 2), (fused, gathers)
    finally:
        comm.remove_interceptor(seen)

    plain = run(0, False, False)
    for chunks, fused, split in ((0, True, False), (2, False, False), (2, True, False), (4, True, True)):
        for i, (got, want) in enumerate(zip(run(chunks, fused, split), plain)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0,
                                       msg=lambda m, i=i, c=(chunks, fused, split): f"overlap {c} tensor {i}: {m}")


def _check_model(cfg: ModelConfig, group, sequence_parallel: bool, what: str, tp_comm_overlap: int = 0) -> None:
    from megatronapp.model.transformer import TransformerChunk, build_model

    ids, labels = _batch()
    ref = build_model(cfg, seed=3)
    ref_loss = ref(ids, labels=labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = TransformerChunk(cfg, 0, cfg.num_layers, True, True, tp_group=group,
                             sequence_parallel=sequence_parallel, seed=3, tp_comm_overlap=tp_comm_overlap)
    loss = model(ids, labels=labels)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0, msg=lambda m: f"{what} loss: {m}")
    loss.backward()
    sync_sequence_parallel_grads(model, group)
    names = set()
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        names.add(n)
        torch.testing.assert_close(_real(_full(p.data, p, group), p), _real(ref_params[n].data, ref_params[n]),
                                   atol=0, rtol=0, msg=lambda m, n=n: f"{what} init of {n}: {m}")
        torch.testing.assert_close(_real(_full(p.grad, p, group), p), _real(ref_grads[n], ref_params[n]),
                                   atol=ATOL, rtol=0, msg=lambda m, n=n: f"{what} grad of {n}: {m}")
    assert names == set(ref_grads), what

    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=ATOL, rtol=0)


def _check_chunks(cfg: ModelConfig, group, sequence_parallel: bool) -> None:
    # A 2-chunk pipeline under TP (+SP): hidden states [b, s/tp, h] flow between chunks; the tied embedding's
    # two copies have gradients that sum to the whole model's.
    from megatronapp.model.transformer import TransformerChunk, build_model

    ids, labels = _batch(1)
    ref = build_model(cfg, seed=5)
    ref_loss = ref(ids, labels=labels)
    ref_loss.backward()
    kw = {"tp_group": group, "sequence_parallel": sequence_parallel, "seed": 5}
    first = TransformerChunk(cfg, 0, 1, True, False, **kw)
    last = TransformerChunk(cfg, 1, cfg.num_layers, False, True, **kw)
    hidden = first(ids)
    assert hidden.shape == (2, 4 if sequence_parallel else 8, cfg.hidden_size)
    sent = hidden.detach().requires_grad_(True)  # what the next stage receives
    loss = last(sent, labels=labels)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    loss.backward()
    hidden.backward(sent.grad)
    for chunk in (first, last):
        sync_sequence_parallel_grads(chunk, group)
    emb_a, emb_b = first.shared_embedding_weight(), last.shared_embedding_weight()
    tied = _real(_full(emb_a.grad + emb_b.grad, emb_a, group), emb_a)
    ref_w = ref.embedding.word.weight
    torch.testing.assert_close(tied, _real(ref_w.grad, ref_w), atol=ATOL, rtol=0)


def _worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    topo = topology.build(tp=world, pp=1, dp=1)
    group = topo.tp_group
    _check_mappings(group, rank)
    _check_overlap(group, rank)
    _check_model(_configs()["llama-gqa"], group, True, "llama-gqa sp=True tp-comm-overlap", tp_comm_overlap=2)
    for sp in (False, True):
        _check_layers(group, rank, sp)
        for name, cfg in _configs().items():
            _check_model(cfg, group, sp, f"{name} sp={sp}")
        _check_chunks(_configs()["gpt2"], group, sp)


def test_tp2_matches_single_process_with_and_without_sequence_parallel():
    spawn(_worker, 2)


def test_single_member_group_degenerates_to_plain_layers():
    group = topology.Group("tp", (0,), None)
    x = torch.randn(2, 3, 6)
    col = ColumnParallelLinear(6, 8, tp_group=group, gather_output=True)
    torch.nn.init.normal_(col.weight)
    torch.testing.assert_close(col(x), F.linear(x, col.weight, col.bias))
    row = RowParallelLinear(8, 6, tp_group=None, sequence_parallel=True)
    torch.nn.init.normal_(row.weight)
    assert not row.sequence_parallel
    y = torch.randn(2, 3, 8)
    torch.testing.assert_close(row(y), F.linear(y, row.weight, row.bias))
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 3)
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, labels, group), ref)
    assert copy_to_tp(x, None) is x and reduce_from_tp(x, group) is x and gather_from_sp(x, None) is x


def test_fused_swiglu_equals_separate_gate_and_up():
    # One GEMM over [gate; up] gives the numbers of down(silu(x gate^T) * (x up^T)), gradients included.
    from megatronapp.model.mlp import MLP

    cfg = _configs()["llama-gqa"]
    mlp = MLP(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(2, 5, cfg.hidden_size, generator=g, requires_grad=True)
    out = mlp(x)
    gate, up, down = (t.detach().clone().requires_grad_(True) for t in (mlp.gate.weight, mlp.up.weight,
                                                                        mlp.down.weight))
    xr = x.detach().clone().requires_grad_(True)
    ref = F.linear(F.silu(F.linear(xr, gate)) * F.linear(xr, up), down)
    torch.testing.assert_close(out, ref)
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout)
    ref.backward(gout)
    for ours, want in ((x, xr), (mlp.gate.weight, gate), (mlp.up.weight, up), (mlp.down.weight, down)):
        torch.testing.assert_close(ours.grad, want.grad)
    assert {n for n, _ in mlp.named_parameters()} == {"gate.weight", "up.weight", "down.weight"}
