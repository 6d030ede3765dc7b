"""Checkpoints that cannot be corrupted or used as an attack: weights-only loading refuses a planted pickle
without running it, steps appear only complete, a torn or corrupt newest step falls back to the previous one,
two jobs cannot write one run directory, and the RNG states survive a weights-only round trip."""
from __future__ import annotations

import builtins
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatronapp.config import ConfigError, RunConfig
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.consolidate import consolidate
from megatronapp.train.trainer import Trainer
from tests.jobs import train_case as _cfg


class _Payload:
    """Unpickling this runs `exec(code)`: what an attacker would plant in a rank file."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (builtins.exec, (self.code,))


def _two_steps(tmp_path):
    tr = Trainer(RunConfig.from_dict(_cfg(tmp_path / "run", **{"train.steps": 2})))
    tr.train_step()
    older = tr.save()
    tr.train_step()
    return tr, older, tr.save()


def test_malicious_pickle_is_refused_without_running(tmp_path):
    tr = Trainer(RunConfig.from_dict(_cfg(tmp_path / "run", **{"train.steps": 1})))
    d = tr.save()
    marker = tmp_path / "pwned"
    evil = {"step": 0, "chunks": [_Payload(f"open({str(marker)!r}, 'w').write('ran')")]}
    torch.save(evil, d / "rank00000.pt")
    # The planted file really is an attack: an unsafe load runs it.
    torch.load(d / "rank00000.pt", weights_only=False)
    assert marker.read_text() == "ran"
    marker.unlink()
    meta = ckpt.load_meta(d)
    meta["files"].pop("rank00000.pt")  # as if the attacker also fixed the checksum: refusal must not rely on it
    (d / "meta.json").write_text(__import__("json").dumps(meta))
    sealed = __import__("hashlib").sha256((d / "meta.json").read_bytes()).hexdigest()
    (d / ckpt.MARKER).write_text(__import__("json").dumps({"meta_sha256": sealed}))  # and resealed meta.json
    with pytest.raises(ckpt.CheckpointError, match="rank00000.pt was refused.*run code"):
        ckpt.load_rank(d, 0)
    with pytest.raises(ckpt.CheckpointError, match="refused"):
        consolidate(d)  # what `scope serve --checkpoint` and exports load through
    with pytest.raises(ckpt.CheckpointError, match="refused"):
        Trainer(RunConfig.from_dict({**_cfg(tmp_path / "run2", **{"train.steps": 1}),
                                     "train": {**_cfg(tmp_path / "run2")["train"], "resume": str(d)}}))
    assert not marker.exists()


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    state = ckpt.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expect = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expect


def test_step_is_invisible_until_every_file_is_written_and_resave_replaces_it_whole(tmp_path, monkeypatch):
    tr, older, newer = _two_steps(tmp_path)
    root = older.parent
    # a save that crashed after writing its rank file: only a hidden temporary directory exists
    monkeypatch.setenv("MEGATRONAPP_RUN_ID", "dead-launch")
    ckpt.save_rank(root, 3, 0, {"step": 3})
    monkeypatch.delenv("MEGATRONAPP_RUN_ID")
    assert not ckpt.step_dir(root, 3).exists() and ckpt.resolve(root) == newer
    assert any(p.name.startswith(".step_00000003.") for p in root.iterdir())
    # re-saving step 2 (a replay after a restart) swaps the whole directory
    tr.step = 2
    again = tr.save()
    assert again == newer and ckpt.verify(again) is None
    assert not any(p.name.startswith(".") for p in root.iterdir()), "temporary directories were left behind"
    assert sorted(p.name for p in again.iterdir()) == ["COMPLETE", "meta.json", "rank00000.pt"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_newest_checkpoint_falls_back_and_says_so(tmp_path, capsys, damage):
    _, older, newer = _two_steps(tmp_path)
    f = newer / "rank00000.pt"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10  # one flipped bit: still a loadable zip, only the checksum tells
    f.write_bytes(bytes(data))
    run = tmp_path / "run"
    assert ckpt.resolve(run, verify_files=True) == older
    err = capsys.readouterr().err
    assert f"unusable, skipped: {newer.name}" in err and f"falling back to {older.name}" in err
    assert ckpt.resolve(run / "checkpoints" / "latest", verify_files=True) == older
    with pytest.raises(ckpt.CheckpointError, match=f"the newest usable one is .*{older.name}"):
        ckpt.resolve(newer, verify_files=True)
    with pytest.raises(ckpt.CheckpointError, match="corrupt or truncated"):
        ckpt.load_rank(newer, 0)


def test_two_jobs_cannot_write_one_run_directory(tmp_path):
    out = tmp_path / "run"
    with ckpt.OutLock(out):
        with pytest.raises(ConfigError, match=f"another job \\(pid {os.getpid()} .*choose another --out"):
            ckpt.OutLock(out).acquire()
    # another process holding the lock (the kernel's flock, as OutLock takes it) is refused too
    holder = ("import fcntl, os, sys\n"
              f"fd = os.open({str(out / '.lock')!r}, os.O_RDWR)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, b'pid 4242 on elsewhere')\n"
              "print('locked', flush=True); sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match="another job \\(pid 4242 on elsewhere\\)"):
            ckpt.OutLock(out).acquire()
    finally:
        child.communicate("", timeout=60)
    ckpt.OutLock(out).acquire().release()  # free again once the other job is gone


def test_async_save_writes_what_a_sync_save_writes_and_keeps_the_newest(tmp_path):
    base = _cfg(tmp_path / "sync", **{"train.steps": 3})
    sync = Trainer(RunConfig.from_dict(base))
    asyn = Trainer(RunConfig.from_dict({**base, "train": {**base["train"], "out": str(tmp_path / "async"),
                                                          "async_save": True, "keep_checkpoints": 2}}))
    announced = []
    asyn.hooks.on("checkpoint_saved", lambda step, path: announced.append(step))
    for _ in range(3):
        sync.train_step()
        asyn.train_step()
        d_sync = sync.save()
        d_async = asyn.save()  # returns after the snapshot; the next train_step changes the live tensors
    asyn.finish_saves()
    assert announced == [1, 2, 3]
    root = d_async.parent
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]  # keep 2
    assert ckpt.resolve(root, verify_files=True) == d_async
    a, s = ckpt.load_rank(d_async, 0), ckpt.load_rank(d_sync, 0)
    for ca, cs in zip(a["chunks"], s["chunks"]):
        assert all(torch.equal(ca[k], cs[k]) for k in cs)
    assert a["step"] == s["step"] == 3


def test_async_savers_of_several_ranks_complete_a_step_only_when_all_files_are_durable(tmp_path):
    from megatronapp.train.async_checkpoint import AsyncSaver

    root = tmp_path / "checkpoints"
    rank0, rank1 = AsyncSaver(root, 0, 2), AsyncSaver(root, 1, 2)
    meta = {"step": 5, "world_size": 2}
    rank0.save(5, {"w": torch.ones(3)}, meta)
    time.sleep(0.3)  # rank 1 is late: rank 0's background thread must wait for its file
    assert not ckpt.step_dir(root, 5).exists()
    rank1.save(5, {"w": torch.zeros(3)}, meta)
    assert rank0.wait() == 5 and rank1.wait() == 5
    d = ckpt.step_dir(root, 5)
    assert ckpt.verify(d) is None and sorted(ckpt.load_meta(d)["files"]) == ["rank00000.pt", "rank00001.pt"]
    assert torch.equal(ckpt.load_rank(d, 1)["w"], torch.zeros(3))


def _delay_background_writes(monkeypatch, seconds: float) -> None:
    """The background thread starts late, so the snapshot barrier has to do the whole copy."""
    from megatronapp.train.async_checkpoint import AsyncSaver

    write = AsyncSaver._write

    def late(self, *args):
        time.sleep(seconds)
        write(self, *args)

    monkeypatch.setattr(AsyncSaver, "_write", late)


def test_overlapped_snapshot_holds_the_state_of_the_save_call_bit_for_bit(tmp_path, monkeypatch):
    from megatronapp.train.async_checkpoint import AsyncSaver

    _delay_background_writes(monkeypatch, 0.5)
    # the contract: after snapshot_barrier() the state may change; the file holds the values at save()
    saver = AsyncSaver(tmp_path / "a", 0, 1, overlap_copy=True)
    w = torch.randn(3 << 20)  # several copy pieces
    before = w.clone()
    saver.save(1, {"w": w}, {"step": 1, "world_size": 1})
    saver.snapshot_barrier()
    w.add_(1.0)
    saver.wait()
    assert torch.equal(ckpt.load_rank(ckpt.step_dir(tmp_path / "a", 1), 0)["w"], before)
    # the control: without the barrier the late copy sees the change (so the check above can fail)
    saver = AsyncSaver(tmp_path / "b", 0, 1, overlap_copy=True)
    saver.save(1, {"w": w}, {"step": 1, "world_size": 1})
    w.add_(1.0)
    saver.wait()
    assert torch.equal(ckpt.load_rank(ckpt.step_dir(tmp_path / "b", 1), 0)["w"], w)

    # the trainer holds the barrier before its optimizer step: the step right after save() changes every
    # parameter and moment, and the checkpoint still equals a synchronous save taken at the same point
    base = _cfg(tmp_path / "sync", **{"train.steps": 3})
    sync = Trainer(RunConfig.from_dict(base))
    asyn = Trainer(RunConfig.from_dict({**base, "train": {**base["train"], "out": str(tmp_path / "async"),
                                                          "async_save": True}}))
    for tr in (sync, asyn):
        tr.train_step()
        tr.train_step()
    d_sync = sync.save()
    d_async = asyn.save()
    before = [{k: v.clone() for k, v in c.state_dict().items()} for c in asyn.chunks]
    asyn.train_step()  # mutates the state while the background thread has not started copying
    assert any(not torch.equal(before[0][k], v) for k, v in asyn.chunks[0].state_dict().items())
    asyn.finish_saves()
    a, s = ckpt.load_rank(d_async, 0), ckpt.load_rank(d_sync, 0)
    assert a["step"] == s["step"] == 2
    for ca, cs in zip(a["chunks"], s["chunks"]):
        assert ca.keys() == cs.keys() and all(torch.equal(ca[k], cs[k]) for k in cs)
    opt_a, opt_s = a["optimizer"]["state"], s["optimizer"]["state"]
    assert opt_a.keys() == opt_s.keys()
    for i in opt_s:
        assert all(torch.equal(opt_a[i][k], opt_s[i][k]) for k in opt_s[i])
    assert torch.equal(a["rng"]["torch"], s["rng"]["torch"])
    assert len(asyn.save_stalls) == 1 and asyn.save_stalls[0] > 0


# -- one reader per DP group on resume ----------------------------------------------------------------------
def test_broadcast_encoding_round_trips_a_rank_state_exactly(tmp_path):
    from megatronapp.train.checkpoint_read import decode, encode

    tr, d, _ = _two_steps(tmp_path)
    state = ckpt.load_rank(d, 0)
    state["extra"] = {3: (1, 2.5, None, True, "x"), "bf": torch.ones(2, dtype=torch.bfloat16), "e": torch.empty(0)}
    desc, tensors = encode(state)
    data = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    got = decode(desc, data)

    def same(a, b):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b) and all(same(a[k], b[k]) is None for k in a)
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b) and all(same(x, y) is None for x, y in zip(a, b))
        else:
            assert a == b

    same(state, got)
    with pytest.raises(ckpt.CheckpointError, match="type _Payload cannot be broadcast"):
        encode({"x": _Payload("pass")})


def _reads_of_rank_files(log: list) -> None:
    """Record every open of a rank file for reading in this process (Python's audit hook sees every open)."""
    import re

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, os.PathLike)) and re.search(r"rank\d{5}\.pt$", str(args[0])):
            mode, flags = args[1], args[2]
            reading = ("r" in mode and "+" not in mode) if isinstance(mode, str) else (flags & 3) == os.O_RDONLY
            if reading:
                log.append(str(args[0]))

    sys.addaudithook(hook)


def _dp_resume_worker(rank: int, world: int, root: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from megatronapp.parallel import comm
    from megatronapp.train.trainer import run_rank

    root_p = Path(root)
    layout = {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.comm_semantics": "nccl",
              "train.steps": 4, "model.num_layers": 2}
    run_rank(rank, world, _cfg(root_p / "straight", **{**layout, "train.save_interval": 2}))
    resumed = _cfg(root_p / "resumed", **layout)
    resumed["train"]["resume"] = str(root_p / "straight" / "checkpoints" / "step_00000002")
    opened: list = []
    _reads_of_rank_files(opened)
    run_rank(rank, world, resumed)
    (root_p / f"opened_rank{rank}.json").write_text(json.dumps(opened))
    # a reader that fails (its file corrupt): every member of its DP group raises, naming the reader
    dist.barrier()
    bad = root_p / "copy" / "step_00000004"
    if rank == 2:
        import shutil

        shutil.copytree(root_p / "straight" / "checkpoints" / bad.name, bad)
        f = bad / "rank00002.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    dist.barrier()
    failing = _cfg(root_p / "failing", **layout)
    failing["train"]["resume"] = str(bad)
    comm.reset()
    try:
        Trainer(RunConfig.from_dict(failing), rank)
        outcome = "loaded"
    except ckpt.CheckpointError as e:
        outcome = str(e)
    (root_p / f"failing_rank{rank}.txt").write_text(outcome)


@pytest.mark.slow
def test_resume_reads_one_file_per_dp_group_and_continues_bit_for_bit(tmp_path):
    import json

    from megatronapp.launch import spawn
    from megatronapp.train.metrics import read_metrics

    spawn(_dp_resume_worker, 4, str(tmp_path))  # dp=2 x pp=2: DP groups {0, 1} and {2, 3}, readers 0 and 2
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    src = straight / "checkpoints" / "step_00000002"
    # reads of the files being committed (rank 0 checks each against its checksum) are not resume reads
    opened = {r: [f for f in json.loads((tmp_path / f"opened_rank{r}.json").read_text()) if "/.step_" not in f]
              for r in range(4)}
    assert opened == {0: [str(src / "rank00000.pt")], 1: [], 2: [str(src / "rank00002.pt")], 3: []}
    # the replicas continue exactly as the uninterrupted run: every step's loss, final weights and moments
    assert ({r["step"]: r["loss"] for r in read_metrics(resumed / "metrics.jsonl")}
            == {r["step"]: r["loss"] for r in read_metrics(straight / "metrics.jsonl") if r["step"] > 2})
    for r in range(4):
        a = ckpt.load_rank(ckpt.step_dir(resumed / "checkpoints", 4), r)
        b = ckpt.load_rank(ckpt.step_dir(straight / "checkpoints", 4), r)
        for ca, cb in zip(a["chunks"], b["chunks"]):
            assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in cb), r
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sb for k in sb[i]), r
        assert a["coord"] == b["coord"]
    # reader failure: both members of the failing group say so, the reader's message included; group {0, 1} loads
    failing = {r: (tmp_path / f"failing_rank{r}.txt").read_text() for r in range(4)}
    assert failing[0] == failing[1] == "loaded"
    assert "rank00002.pt is corrupt or truncated" in failing[2]
    assert failing[3].startswith("rank 2, the reader of this rank's DP group, could not load")
    assert "rank00002.pt is corrupt or truncated" in failing[3]
