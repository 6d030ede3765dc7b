"""The modelled wire of emulated runs: ring byte counts, per-group serialisation, and handles held until due."""
from __future__ import annotations

import time

import pytest

from megatronapp.parallel import comm
from megatronapp.parallel.link_model import LinkModel, wire_bytes


def _op(name: str, group: str = "dp", ranks: tuple[int, ...] = (0, 1), nbytes: int = 1000, peer=None):
    return comm.CommOp(name, group, ranks, 0, nbytes, peer)


def test_ring_bytes_per_rank():
    assert wire_bytes(_op("all_reduce", ranks=(0, 1, 2, 3))) == pytest.approx(2 * 3 / 4 * 1000)
    assert wire_bytes(_op("reduce_scatter", ranks=(0, 1))) == pytest.approx(500)
    assert wire_bytes(_op("send", group="pp.act.up", peer=1)) == 1000
    assert wire_bytes(_op("recv", peer=1)) == 0 and wire_bytes(_op("barrier", nbytes=0)) == 0


def test_ops_of_one_group_share_its_wire_and_unlisted_groups_are_free():
    wire = LinkModel({"dp": 1e-6, "pp": 1e-6})  # 1 kB/s: 1000 B all-reduced over 2 ranks take 1 s
    first = wire(_op("all_reduce"))
    second = wire(_op("all_reduce"))  # issued while the first is on the wire: starts after it
    assert first == pytest.approx(1.0, abs=0.05) and second == pytest.approx(2.0, abs=0.05)
    assert wire(_op("send", group="pp.act.up", peer=1)) == pytest.approx(1.0, abs=0.05)  # its own wire
    assert wire(_op("all_reduce", group="tp")) is None  # no speed stated for tp: not modelled
    assert wire(_op("recv", group="pp.act.down", peer=1)) is None  # the send carries the transfer
    assert wire.busy_s["dp"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="must be > 0"):
        LinkModel({"dp": 0.0})


def test_a_handle_is_not_complete_before_its_wire_time():
    due = time.monotonic() + 0.2
    h = comm.Handle(None, None, due=due)  # the op itself is done at once (no work); the wire is not
    assert not h.is_completed() and not h.done
    h.wait()
    assert time.monotonic() >= due and h.is_completed() and h.done
    assert comm.Handle(None, None).is_completed()  # no wire: complete at once, as before
