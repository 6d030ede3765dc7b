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


def test_no_temporary_is_named_after_a_launcher_run_id_and_the_reshard_commits_its_own_attempt(tmp_path,
                                                                                               monkeypatch):
    """A save one process writes alone (the driver's reshard for a shrunk restart) uses an attempt id of its own,
    not TORCHELASTIC_RUN_ID (`none` under static rendezvous) nor a fixed name: a crashed earlier attempt's files
    under those names are never committed, and the commit removes them."""
    from megatronapp.config import RunConfig
    from megatronapp.resilience import shrink

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MEGATRONAPP_RUN_ID", "job")
    src_root, attempt = tmp_path / "src", "agreed"
    saved = RunConfig.from_dict({"parallel": {"dp": 2}})
    for r in range(2):
        ckpt.save_rank(src_root, 4, r, {"step": 4, "w": torch.tensor([float(r)]), "coord": {}}, attempt)
    src = ckpt.finalize(src_root, 4, {"step": 4, "world_size": 2, "config": saved.to_dict()}, attempt=attempt)
    dst_root = tmp_path / "dst"
    used: list[str] = []
    temp_dir = ckpt.temp_dir

    def spy(root, step, attempt=None):
        if not used:  # after the reshard cleared its directory: what a crashed attempt under the old names left
            for old in ("none", "job"):
                leftover = root / f".step_00000004.{old}"
                leftover.mkdir(parents=True)
                (leftover / "rank00000.pt").write_bytes(b"planted")
                (leftover / "rank00000.pt.sum").write_bytes(b'{"bytes": 7, "sha256": "x"}')
        d = temp_dir(root, step, attempt)
        used.append(d.name)
        return d

    monkeypatch.setattr(ckpt, "temp_dir", spy)
    final = shrink.reshard(src, dst_root, RunConfig.from_dict({"parallel": {"dp": 1}}), [1])
    assert float(ckpt.load_rank(final, 0)["w"]) == 1.0 and ckpt.verify(final) is None
    names = set(used)
    assert len(names) == 1 and not names & {".step_00000004.none", ".step_00000004.job"}, names
    assert not [p.name for p in dst_root.iterdir() if p.name.startswith(".step_")]
    # a lone save without an agreed id: this process's own attempt, never the launcher's run id
    path = ckpt.save_rank(tmp_path / "alone", 2, 0, {"step": 2})
    assert path.parent.name.split(".")[-1] not in ("none", "job")
