"""Checkpoints that cannot be corrupted or used as an attack: weights-only loading refuses a planted pickle
without running it, steps appear only complete, a torn or corrupt newest step falls back to the previous one,
two jobs cannot write one run directory, and the RNG states survive a weights-only round trip."""
from __future__ import annotations

import builtins
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatronapp.config import ConfigError, RunConfig
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.consolidate import consolidate
from megatronapp.train.trainer import Trainer
from tests.test_training import _cfg


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
