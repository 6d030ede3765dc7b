"""Sharded initialisation: each TP rank generates only its own slice of every weight, bit-identical to the slice
of the one-process model, and never holds a full weight while doing so."""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatronapp.config import ModelConfig
from megatronapp.model import init
from megatronapp.model.transformer import TransformerChunk, build_model
from megatronapp.parallel.tensor_parallel import shard
from megatronapp.parallel.topology import Group


@contextlib.contextmanager
def as_tp_rank(size: int, rank: int) -> Iterator[Group]:
    """A TP group of `size` in which this process plays rank `rank`: enough to build that rank's chunk, which
    needs no communication, without starting `size` processes."""
    with mock.patch("torch.distributed.get_rank", return_value=rank):
        yield Group("tp", tuple(range(size)))


def _reference(full: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """Today's definition of a weight: one randn over the full shape."""
    return torch.randn(full, generator=torch.Generator().manual_seed(seed)) * std


@pytest.mark.parametrize("full, dim, parts", [
    ((40, 24), 0, 4), ((40, 24), 1, 4), ((7, 5), 0, 1), ((3, 3), 0, 1), ((1, 5), 0, 1), ((33, 6), 1, 3),
    ((13,), 0, 1), ((9, 4, 6), 1, 2), ((9, 4, 6), 2, 3), ((64, 17), 0, 8), ((17, 64), 1, 8),
])
@pytest.mark.parametrize("block", [1, 16, 50, 10_000])
def test_shard_equals_slice_of_one_randn(full, dim, parts, block):
    ref = _reference(full, 11, 0.5)
    local = full[dim] // parts
    for rank in range(parts):
        out = torch.full(ref.narrow(dim, 0, local).shape, float("nan"))
        init.fill_normal_shard(out, full, dim, rank, 0.5, torch.Generator().manual_seed(11), block)
        assert torch.equal(out, ref.narrow(dim, rank * local, local)), (rank, block)


@pytest.mark.parametrize("block", [16, 10_000])
def test_padded_rows_past_the_real_ones_are_zero(block):
    real = (37, 8)  # a 37-token vocabulary padded to 48 rows, 12 per rank at tp=4
    ref = _reference(real, 5, 1.0)
    got = []
    for rank in range(4):
        out = torch.full((12, 8), float("nan"))
        init.fill_normal_shard(out, real, 0, rank, 1.0, torch.Generator().manual_seed(5), block)
        got.append(out)
    padded = torch.cat(got)
    assert torch.equal(padded[:37], ref) and not padded[37:].any()


@pytest.mark.parametrize("rows, row_numel", [(100, 3), (5, 3), (1000, 24), (7, 1), (2, 100)])
def test_row_blocks_cover_rows_with_whole_groups_of_16(rows, row_numel):
    blocks = list(init.row_blocks(rows, row_numel, block_numel=40))
    assert [s for s, _ in blocks] == [0] + [e for _, e in blocks[:-1]] and blocks[-1][1] == rows
    assert all((e - s) * row_numel % 16 == 0 for s, e in blocks[:-1])
    assert (blocks[-1][1] - blocks[-1][0]) * row_numel >= min(16, rows * row_numel)


_CONFIGS = {
    "gpt2": ModelConfig(family="gpt2", vocab_size=200, hidden_size=48, num_layers=2, num_heads=4, max_seq_len=24),
    "llama-gqa": ModelConfig(family="llama", vocab_size=300, hidden_size=64, num_layers=2, num_heads=8,
                             num_kv_heads=4, ffn_hidden_size=96),
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_holds_its_slice_of_the_one_process_model(name, tp, monkeypatch):
    cfg = _CONFIGS[name]
    whole = dict(build_model(cfg, seed=3).named_parameters())
    monkeypatch.setattr(init, "BLOCK_NUMEL", 100)  # many blocks per weight, and blocks cut across rows
    for rank in range(tp):
        with as_tp_rank(tp, rank) as group:
            # The whole model, and a last pipeline stage that holds the output weight without the embedding.
            for chunk in (build_model(cfg, seed=3, tp_group=group),
                          TransformerChunk(cfg, 1, 2, pre_process=False, post_process=True, tp_group=group, seed=3)):
                for n, p in chunk.named_parameters():
                    one = whole[chunk.init_name(n)]  # a tied output copy starts as the embedding
                    want = shard(one[:p.vocab_size] if hasattr(p, "vocab_size") else one, p, group)
                    assert torch.equal(p.detach(), want), (name, tp, rank, n)


def test_meta_device_builds_shapes_without_storage():
    cfg = _CONFIGS["llama-gqa"]
    with as_tp_rank(4, 1) as group:
        meta = build_model(cfg, tp_group=group, device="meta")
        real = build_model(cfg, tp_group=group)
    shapes = {n: (p.shape, p.device.type) for n, p in meta.named_parameters()}
    assert shapes == {n: (p.shape, "meta") for n, p in real.named_parameters()}


class _CpuAllocations(TorchDispatchMode):
    """Bytes of CPU storage created while active: the largest single one and the peak held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  and t.device.type == "cpu"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in inputs:
                continue  # a view or an in-place result: no new memory
            self.live += storage.nbytes()
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, storage.nbytes())
            weakref.finalize(storage, self._freed, storage.nbytes())
        return out


def test_a_tp8_rank_never_holds_a_full_weight():
    # Embedding and output [16384, 512] (32 MiB each) dominate; a tp=8 rank holds an eighth of each.
    cfg = ModelConfig(family="llama", vocab_size=16384, hidden_size=512, num_layers=2, num_heads=8,
                      ffn_hidden_size=1536)
    full_bytes = 4 * cfg.num_params()
    largest_full = 4 * cfg.vocab_size * cfg.hidden_size
    with as_tp_rank(8, 5) as group, _CpuAllocations() as alloc:
        chunk = build_model(cfg, tp_group=group)
    shard_bytes = sum(p.numel() * p.element_size() for p in chunk.parameters())
    assert shard_bytes * 7 < full_bytes  # the chunk itself is about an eighth of the model
    # Beyond its own shard a rank holds at most a few blocks of the generator's stream at once.
    assert alloc.largest <= max(4 * init.BLOCK_NUMEL, largest_full // 8), alloc.largest
    assert alloc.peak <= shard_bytes + 3 * 4 * init.BLOCK_NUMEL, (alloc.peak, shard_bytes)
    assert alloc.peak < full_bytes / 4


def test_benchmark_peer_is_the_former_initialisation():
    # bench_startup_memory's peer must draw the same weights, padding rows included (8000 ids padded to 8192).
    from benchmarks import bench_startup_memory as bench

    shape = {**bench.QUICK, "vocab_size": 8000}
    whole, sharded = (bench.measure(shape, 8, 7, path) for path in ("whole", "sharded"))
    assert whole["sha256"] == sharded["sha256"] and whole["params_mib"] == sharded["params_mib"]
