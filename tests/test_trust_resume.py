"""A resume reads state, not instructions: from a checkpoint's meta.json only the model, the layout, the optimizer
and the data position are taken (checksummed like the rank files); plug-ins, fault drills, the console port and
every path come from the user. A resumed copy of a run directory writes into the copy."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import ConfigError, RunConfig
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.trainer import Trainer
from tests.forge import edit_meta, write_meta
from tests.test_training import _cfg

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _saved_run(out: Path) -> Path:
    tr = Trainer(RunConfig.from_dict(_cfg(out, **{"train.steps": 1, "model.num_layers": 2})))
    tr.train_step()
    return tr.save()


def _tamper(step: Path, reseal: bool = True, **changes) -> None:
    """Rewrite meta.json's saved config as an attacker with write access would, sealing it again (the marker's
    checksum) so only the resume's own rules stand between the file and the run."""
    meta = json.loads((step / "meta.json").read_text())
    for key, value in changes.items():
        section, _, name = key.partition(".")
        if name:
            meta["config"][section][name] = value
        else:
            meta["config"][section] = value
    write_meta(step, meta, reseal)


def _copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run directory, without the original's lock file."""
    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_resumed_copy_imports_nothing_named_by_its_checkpoint_and_writes_into_the_copy(tmp_path):
    step = _saved_run(tmp_path / "orig")
    copy = _copy_run(tmp_path / "orig", tmp_path / "copy")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    pwned = tmp_path / "pwned"
    (cwd / "pwnmod.py").write_text(f"open({str(pwned)!r}, 'w').write('imported')\ndef plugin(trainer):\n    pass\n")
    _tamper(copy / "checkpoints" / step.name, attach=["pwnmod"], inject=["hang=0:1"],
            **{"train.keep_checkpoints": 1, "train.out": str(tmp_path / "orig")})
    before = sorted(p.name for p in (tmp_path / "orig" / "checkpoints").iterdir())
    r = subprocess.run([sys.executable, "-m", "megatronapp", "train", "--resume", str(copy), "--steps", "2",
                        "--no-progress"], cwd=cwd, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 0, r.stderr[-2000:]
    assert not pwned.exists(), "a module named by a checkpoint's meta.json was imported"
    assert ckpt.is_complete(copy / "checkpoints" / "step_00000002"), "the resumed copy did not write into the copy"
    assert sorted(p.name for p in (tmp_path / "orig" / "checkpoints").iterdir()) == before
    assert ckpt.is_complete(copy / "checkpoints" / step.name), "keep_checkpoints came from the checkpoint"


def test_only_state_comes_from_a_checkpoint(tmp_path):
    step = _saved_run(tmp_path / "run")
    _tamper(step, attach=["builtins:print"], inject=["hang=0:1"], scope_port=8123,
            trace={"enabled": True, "dir": str(tmp_path / "elsewhere"), "interval": 1, "iterations": 1,
                   "granularity": "coarse"},
            **{"train.keep_checkpoints": 1, "train.tensorboard": str(tmp_path / "tb"), "train.lr": 0.5})
    cfg = config_from_args(_args("--resume", str(step), "--steps", "3"))
    assert cfg.attach == [] and cfg.inject == [] and cfg.scope_port is None and not cfg.trace.enabled
    assert cfg.train.keep_checkpoints == 0 and cfg.train.tensorboard is None
    assert cfg.train.out == str(tmp_path / "run")  # the run directory the user named, not the saved one
    assert cfg.train.lr == 0.5  # the optimizer's settings are state: they do come from the checkpoint
    assert cfg.model.num_layers == 2
    # the user's own flags still count
    cfg = config_from_args(_args("--resume", str(step), "--steps", "3", "--attach", "builtins:print",
                                 "--out", str(tmp_path / "new")))
    assert cfg.attach == ["builtins:print"] and cfg.train.out == str(tmp_path / "new")


def test_a_saved_data_path_must_be_named_by_the_user(tmp_path):
    step = _saved_run(tmp_path / "run")
    _tamper(step, **{"train.data": "/etc/passwd"})
    with pytest.raises(ConfigError, match=r"train.data=.*pass --data"):
        config_from_args(_args("--resume", str(step), "--steps", "3"))
    data = tmp_path / "d.txt"
    data.write_text("hello world " * 50)
    assert config_from_args(_args("--resume", str(step), "--steps", "3", "--data", str(data))).train.data == str(data)


def test_an_altered_meta_json_fails_its_checksum(tmp_path):
    step = _saved_run(tmp_path / "run")
    assert ckpt.verify(step) is None
    _tamper(step, reseal=False, attach=["builtins:print"])
    assert "meta.json" in (ckpt.verify(step) or "")
    with pytest.raises(ConfigError, match="meta.json"):
        config_from_args(_args("--resume", str(step), "--steps", "3"))


def _resume(run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatronapp", "train", "--resume", str(run), "--steps", "3",
                           "--no-progress", *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC})


def test_a_torn_shard_or_a_false_zero_claim_is_an_error_naming_the_file_not_a_traceback(tmp_path):
    step = _saved_run(tmp_path / "run")
    zero = _copy_run(tmp_path / "run", tmp_path / "zero")
    f = step / "rank00000.pt"
    f.write_bytes(f.read_bytes()[:1000])
    r = _resume(tmp_path / "run")
    assert r.returncode == 2 and "rank00000.pt has 1000 bytes" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # meta.json claims ZeRO-1 (sealed again): a resume on plain DP reshards, and the rank file has no ZeRO layout
    edit_meta(zero / "checkpoints" / step.name, config__parallel__zero=1)
    r = _resume(zero, "--zero", "0")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "rank00000.pt: its optimizer state does not fit meta.json's parallel.zero=1" in r.stderr, r.stderr
