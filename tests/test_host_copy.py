"""No host-to-device copy on a per-message or per-microbatch path makes the host wait (issue 39, item 1).

The meta device plays the GPU (tests/fake_gpu.py): a copy from the host to it counts as blocking unless the source
is pinned and the copy `non_blocking`, which is CUDA's rule. The CPU cannot time a GPU, but it can count these.
"""
from __future__ import annotations

import torch

from megatronapp.config import preset
from megatronapp.fbd.groups import PairLinks
from megatronapp.fbd.messages import Outbox
from megatronapp.model.transformer import build_model
from megatronapp.parallel import comm, host_copy, topology
from megatronapp.parallel.group import Group
from megatronapp.pipeline.p2p import HEADER_BYTES, StageLinks
from tests.fake_gpu import FAKE_GPU, BlockingCopies


class _SentHandle:
    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        pass


def test_the_counter_sees_a_blocking_copy():
    """The stand-in counts what CUDA would block on, so the tests below can fail."""
    with BlockingCopies() as c:
        torch.ones(3).to(FAKE_GPU)  # pageable
        torch.empty(3, device=FAKE_GPU).copy_(torch.ones(3), non_blocking=True)  # pageable, non_blocking
        torch.ones(3).pin_memory().to(FAKE_GPU)  # pinned, blocking
        torch.ones(3).pin_memory().to(FAKE_GPU, non_blocking=True)  # the one that does not block
    assert len(c.blocking) == 3 and c.copies == 4


def test_pipeline_send_writes_its_header_without_blocking(monkeypatch):
    sent = []
    monkeypatch.setattr(comm, "isend", lambda buf, dst, group: sent.append(buf) or _SentHandle())
    topo = topology.build(1, 2, 1, rank=0)
    links = StageLinks(topo, (2, 4, 8), torch.float32, FAKE_GPU)
    out = torch.empty(2, 4, 8, device=FAKE_GPU)
    with BlockingCopies() as c:
        for mb in range(3):
            links.send("F", 0, mb, out)
    assert c.blocking == [], c.blocking
    assert c.copies == 3 and len(sent) == 3  # one header per message, none of them a host wait
    assert sent[0].numel() == HEADER_BYTES + 2 * 4 * 8 * 4


def test_fbd_outbox_writes_its_header_without_blocking(monkeypatch):
    monkeypatch.setattr(comm, "isend", lambda buf, dst, group: _SentHandle())
    box = Outbox(PairLinks.single(Group("fbd.act", (0, 1)), 1), (2, 4, 8), torch.float32, FAKE_GPU)
    with BlockingCopies() as c:
        for mb in range(3):
            box.send(1, 0, (0, mb, 1), torch.empty(2, 4, 8, device=FAKE_GPU))
    assert c.blocking == [] and c.copies == 3, c.blocking


def test_llama_chunk_forward_copies_rope_frequencies_without_blocking():
    model = build_model(preset("llama-tiny"), device="meta")
    ids = torch.zeros(2, 16, dtype=torch.long, device=FAKE_GPU)
    with BlockingCopies() as c:
        for _ in range(3):
            model(ids)
    assert c.blocking == [], c.blocking
    assert c.copies <= 1  # the frequencies reach the device once, not once per forward


def test_microbatches_reach_the_device_without_blocking():
    ids, labels = torch.arange(32).view(4, 8), torch.arange(32).view(4, 8) + 1
    with BlockingCopies() as c:
        pinned = ids.pin_memory()  # what the prefetch worker hands over on a GPU
        moved = host_copy.microbatches_to([(pinned[:2], labels[:2]), (pinned[2:], labels[2:])], FAKE_GPU)
    assert c.blocking == [] and c.copies == 4
    assert all(a.device == FAKE_GPU and b.device == FAKE_GPU for a, b in moved)
    cpu = host_copy.microbatches_to([(ids, labels)], torch.device("cpu"))
    assert cpu[0][0] is ids  # on the CPU nothing is copied


def test_header_values_land_on_the_device():
    dst = torch.zeros(4, dtype=torch.int32)
    host_copy.write_ints(dst, [7, 1, 2, 3])
    assert dst.tolist() == [7, 1, 2, 3]
