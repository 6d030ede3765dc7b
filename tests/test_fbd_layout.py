"""MegaFBD's pure mappings, for every backward/forward layout pair the process tests use (no processes).

- The weight plan moves the backward shards into exactly the forward shards of the same full weights (vocab
  padding differs between tp and tp_f: real rows move, padding stays zero).
- Stage inputs: what each forward rank sends equals what each backward rank expects, stream by stream and in
  the same order (NCCL matches point-to-point messages by order).
- validate() refuses impossible pairs naming the field, and --nproc names the right total.
"""
from __future__ import annotations

import pytest
import torch

from megatronapp.config import ConfigError, ModelConfig, RunConfig, validate
from megatronapp.fbd.layout import FbdLayout, tp_overlaps, weight_plan
from megatronapp.fbd.weights import param_specs

PAIRS = {  # name: (backward tp, pp, dp, vpp; forward tp_f, pp_f, instances)
    "tp2pp2 <- fwd tp1pp1 x1": FbdLayout(2, 2, 1, 1, 1, 1, 1, 8),
    "tp2pp2 <- fwd tp2pp1 x2": FbdLayout(2, 2, 1, 1, 2, 1, 2, 8),
    "tp2pp2 <- fwd tp2pp2 x1": FbdLayout(2, 2, 1, 1, 2, 2, 1, 8),
    "pp2dp2 <- fwd tp1pp1 x1": FbdLayout(1, 2, 2, 1, 1, 1, 1, 4),
    "pp2dp2 <- fwd tp1pp1 x3": FbdLayout(1, 2, 2, 1, 1, 1, 3, 4),
    "pp2vpp2 <- fwd tp1pp1 x1": FbdLayout(1, 2, 1, 2, 1, 1, 1, 4),
    "pp4vpp2 <- fwd tp1pp2 x2": FbdLayout(1, 4, 1, 2, 1, 2, 2, 6),
    # a forward tp between 1 and tp: each forward shard is the union of two backward shards
    "tp4pp2 <- fwd tp2pp1 x1": FbdLayout(4, 2, 1, 1, 2, 1, 1, 8),
    "tp4pp2dp2 <- fwd tp2pp2 x3": FbdLayout(4, 2, 2, 1, 2, 2, 3, 4),
}


def _model(family: str) -> ModelConfig:
    extra = {"num_kv_heads": 2} if family == "llama" else {}
    return ModelConfig(family=family, vocab_size=200, hidden_size=32, num_layers=8, num_heads=4, max_seq_len=32,
                       **extra)


def _shard(full: torch.Tensor, dim: int | None, local: int, index: int) -> torch.Tensor:
    """Shard `index` of `full` split in shards of `local` along `dim`, zero past its end (padding)."""
    if dim is None:
        return full.clone()
    shape = list(full.shape)
    shape[dim] = local
    out = torch.zeros(shape)
    lo, hi = index * local, min((index + 1) * local, full.shape[dim])
    if hi > lo:
        out.narrow(dim, 0, hi - lo).copy_(full.narrow(dim, lo, hi - lo))
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_weight_plan_moves_backward_shards_into_forward_shards(pair, family):
    L, cfg = PAIRS[pair], _model(family)
    specs = param_specs(cfg, L)
    g = torch.Generator().manual_seed(0)
    full = {}
    for s in specs:  # the real (unpadded) full tensor of each parameter, random
        shape = [4, 3] if s.dim is None else [s.real, 5] if s.dim == 0 else [5, s.real]
        full[s.name] = torch.randn(shape, generator=g)
    src, dst = {}, {}
    for s in specs:
        for d in range(L.dp):
            for t in range(L.tp):
                src[(L.backward_rank(d, s.v % L.pp, t), s.name)] = _shard(full[s.name], s.dim, s.local_b, t)
        for k in range(L.n_f):
            for t in range(L.tp_f):
                key = (L.forward_rank(k, L.forward_stage_of(s.v), t), s.name)
                dst[key] = torch.full_like(_shard(full[s.name], s.dim, s.local_f, t), float("nan"))
    for tr in weight_plan(L, specs):
        a, b = src[(tr.src, tr.name)], dst[(tr.dst, tr.name)]
        if tr.dim is None:
            b.copy_(a)
        else:
            b.narrow(tr.dim, tr.dst_start, tr.length).copy_(a.narrow(tr.dim, tr.src_start, tr.length))
    by_name = {s.name: s for s in specs}
    for (rank, name), got in dst.items():
        s = by_name[name]
        want = _shard(full[name], s.dim, s.local_f, L.forward_coord(rank)[2])
        got = torch.nan_to_num(got, nan=0.0)  # padding is never sent: it stays the forward side's own zeros
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, n=name, r=rank: f"{pair} {n} rank {r}: {m}")
        real = _shard(full[name], s.dim, s.local_f, L.forward_coord(rank)[2]).ne(0)
        assert not dst[(rank, name)][real].isnan().any(), f"{pair}: {name} on rank {rank} not fully written"


def test_vocab_padding_differs_between_tp_and_tp1_and_only_real_rows_move():
    cfg = ModelConfig(family="gpt2", vocab_size=200, hidden_size=32, num_layers=4, num_heads=4, max_seq_len=32)
    assert cfg.padded_vocab_size(2) == 256 and cfg.padded_vocab_size(1) == 256
    cfg.make_vocab_size_divisible_by = 96
    assert cfg.padded_vocab_size(2) == 384 and cfg.padded_vocab_size(1) == 288  # shards 192 | 288
    # tp=2 shards of 192 rows -> one tp_f=1 shard of 288 rows: rows 0..191 from shard 0, 192..199 from shard 1
    assert tp_overlaps(192, 2, 288, 1, 200) == [(0, 0, 0, 0, 192), (1, 0, 0, 192, 8)]


@pytest.mark.parametrize("pair", list(PAIRS))
def test_every_stage_input_is_sent_once_in_the_order_it_is_expected(pair):
    L = PAIRS[pair]
    sent: dict[tuple[int, int], list] = {}
    for r in range(L.backward_world, L.total):
        for dst, key in L.forward_sends(r):
            sent.setdefault((r, dst), []).append(key)
    expected = {(src, r): keys for r in range(L.backward_world) for src, keys in L.backward_inputs(r).items()}
    assert sent == expected
    # every backward virtual stage but the first gets every microbatch of its replica, once per TP rank
    n = sum(len(k) for k in expected.values())
    assert n == L.dp * L.microbatches * (L.virtual_stages - 1) * L.tp


@pytest.mark.parametrize("tp, tp_f", [(4, 2), (4, 1), (4, 4), (2, 1), (2, 2)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_stage_input_conversion_resplits_the_sequence_for_every_backward_tp_rank(tp, tp_f, sequence_parallel):
    """What backward TP rank t receives equals what the coupled pipeline would hand it: the whole hidden state,
    or under sequence parallelism its slice t of tp. Checked on a tensor whose every sequence position differs."""
    L = FbdLayout(tp, 2, 1, 1, tp_f, 1, 1, 4)
    seq = 8
    full = torch.arange(2 * seq * 3, dtype=torch.float32).view(2, seq, 3)  # (batch, sequence, hidden)
    # what each forward TP rank holds after its stage: the whole sequence, unless it runs sequence-parallel
    forward_sp = sequence_parallel and tp_f == tp and tp > 1
    held = {f: full.chunk(tp_f, dim=1)[f] if forward_sp else full for f in range(tp_f)}
    senders = set()
    for t in range(tp):
        f = L.forward_coord(L.input_sender(1, 0, t))[2]
        senders.add(f)
        i = L.input_part(t, sequence_parallel)
        got = held[f] if i is None else held[f].chunk(tp, dim=1)[i]
        want = full.chunk(tp, dim=1)[t] if sequence_parallel and tp > 1 else full
        assert torch.equal(got, want), (tp, tp_f, sequence_parallel, t)
    assert senders == set(range(tp_f))  # every forward TP rank sends its share


def _fbd_cfg(**parallel) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.fbd, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.microbatches = True, 2, 2, 8
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("fields, word", [
    ({"fbd_forward_tp": 3}, "parallel.fbd_forward_tp=3 must divide parallel.tp=2"),
    ({"fbd_forward_pp": 3}, "parallel.fbd_forward_pp=3"),
    ({"fbd_forward_instances": 0}, "parallel.fbd_forward_instances=0"),
    ({"schedule": "dpp"}, "parallel.schedule='dpp'"),
])
def test_validate_refuses_impossible_pairs_naming_the_field(fields, word):
    with pytest.raises(ConfigError, match=word.replace("(", r"\(")):
        validate(_fbd_cfg(**fields))


def test_nproc_must_equal_backward_plus_forward_ranks():
    cfg = _fbd_cfg(fbd_forward_tp=2, fbd_forward_instances=2)
    assert cfg.parallel.total_ranks == 4 + 2 * 2
    validate(cfg, 8)
    with pytest.raises(ConfigError, match="set --nproc 8"):
        validate(cfg, 4)


def test_cli_refuses_a_wrong_nproc_with_the_right_number(capsys):
    from megatronapp.cli import main

    code = main(["train", "--fbd", "--tp", "2", "--pp", "2", "--microbatches", "8", "--fbd-forward-tp", "1",
                 "--fbd-forward-pp", "1", "--fbd-forward-instances", "1", "--nproc", "4"])
    assert code == 2
    assert "set --nproc 5" in capsys.readouterr().err


def test_cli_refuses_supervise_with_fbd(capsys, tmp_path):
    from megatronapp.cli import main

    code = main(["train", "--fbd", "--pp", "2", "--microbatches", "4", "--supervise", "--out", str(tmp_path)])
    assert code == 2
    assert "--supervise does not run MegaFBD jobs" in capsys.readouterr().err


@pytest.mark.parametrize("pair", list(PAIRS))
def test_every_fbd_p2p_stream_is_a_two_rank_link_of_the_plan(pair):
    # Under eager NCCL init a group's ops share one stream: a group with two peers of one rank could make two
    # streams' orders wait on each other (fbd/groups.py). Every stage-input and weight message must travel on a
    # 2-rank group whose members are exactly its sender and receiver, and each rank holds a link to every peer
    # the plan gives it, no more.
    from megatronapp.fbd.groups import build

    L = PAIRS[pair]
    plan_pairs = {(tr.src, tr.dst) for tr in weight_plan(L, param_specs(_model("gpt2"), L))}
    act_pairs = {(f, dst) for f in range(L.backward_world, L.total) for dst, _ in L.forward_sends(f)}
    act_pairs |= {(src, b) for b in range(L.backward_world) for src in L.backward_inputs(b)}
    for rank in range(L.total):
        g = build(L, rank, plan_pairs)
        for links, pairs in ((g.act, act_pairs), (g.weights, plan_pairs)):
            want = {b if a == rank else a for a, b in pairs if rank in (a, b)}
            assert set(links.by_peer) == want, (links.name, rank)
            for peer, group in links.by_peer.items():
                assert group.ranks == tuple(sorted((rank, peer))), (links.name, rank, peer, group.ranks)
        assert all(len(x.ranks) == 2 for x in (g.forward_chain, g.forward_next) if x is not None)
