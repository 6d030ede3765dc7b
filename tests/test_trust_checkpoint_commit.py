"""A checkpoint commit cannot mix save attempts: each launch writes into a temporary directory named by an id all
its ranks agreed on (not TORCHELASTIC_RUN_ID, which is `none` under static rendezvous and survives torchrun
restarts), the committer checks every file on disk against the checksum its rank wrote, and temporary
directories of failed attempts are removed by the next commit."""
from __future__ import annotations

import time

import pytest
import torch

from megatronapp.train import checkpoint as ckpt
from megatronapp.train.async_checkpoint import AsyncSaver


def test_a_leftover_shard_of_an_earlier_attempt_is_never_committed(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRONAPP_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # static rendezvous: the same on every attempt
    root = tmp_path / "checkpoints"
    # an earlier attempt died after rank 1 had written step 5 (file and checksum)
    ckpt.save_rank(root, 5, 1, {"step": 5, "who": torch.tensor([666])})
    meta = {"step": 5, "world_size": 2}
    lead, other = AsyncSaver(root, 0, 2), AsyncSaver(root, 1, 2)
    lead.save(5, {"step": 5, "who": torch.tensor([0])}, meta, attempt="a2")
    time.sleep(0.5)
    assert not ckpt.step_dir(root, 5).exists(), "rank 0 committed before rank 1 of this attempt wrote its file"
    other.save(5, {"step": 5, "who": torch.tensor([1])}, meta, attempt="a2")
    assert lead.wait() == 5 and other.wait() == 5
    d = ckpt.step_dir(root, 5)
    assert ckpt.verify(d) is None
    assert [int(ckpt.load_rank(d, r)["who"]) for r in (0, 1)] == [0, 1]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".step_")], "a failed attempt's files remain"


def test_the_committer_checks_the_bytes_on_disk(tmp_path):
    root = tmp_path / "checkpoints"
    path = ckpt.save_rank(root, 3, 0, {"step": 3, "w": torch.arange(1000.0)})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # what reached the disk is not what was hashed
    path.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="rank00000.pt on disk does not match"):
        ckpt.finalize(root, 3, {"step": 3, "world_size": 1})
    assert not ckpt.step_dir(root, 3).exists()
