"""`export`, `generate` and `scope serve` read a checkpoint or a model directory as data: a tokenizer path a
checkpoint names is not opened (let alone copied into the export), a source's tokenizer.json is read and parsed
as a tokenizer before it is written, outputs are created fresh (a planted symlink or hard link in OUT is replaced,
its target untouched; a stale index is removed), and a checkpoint that is not whole (its meta.json's world_size
2, 0 or -1, a rank file missing or forged) is refused with a message naming the file, never exported in part."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatronapp.cli import main
from megatronapp.config import RunConfig
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.export import export_hf
from tests.engine_cases import base_case
from tests.forge import edit_meta

SECRET = "secret: the key to everything\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One trained 2-layer GPT-2 checkpoint (byte tokenizer); tests forge copies of it."""
    from megatronapp.train.trainer import Trainer

    d = base_case("gpt2", **{"model.num_layers": 2})
    d["train"]["out"] = str(tmp_path_factory.mktemp("run") / "run")
    tr = Trainer(RunConfig.from_dict(d))
    tr.train_step()
    return tr.save()


@pytest.fixture
def step(saved, tmp_path) -> Path:
    """A fresh copy of the checkpoint to forge."""
    out = tmp_path / "checkpoints" / saved.name
    shutil.copytree(saved, out)
    return out


def _secret(tmp_path: Path) -> Path:
    f = tmp_path / "secret.txt"
    f.write_text(SECRET)
    return f


def _holds_secret(d: Path) -> bool:
    return d.is_dir() and any(SECRET.strip() in p.read_text(errors="replace") for p in d.iterdir() if p.is_file())


def _tokenizer_file(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["after monday comes tuesday"] * 5, trainers.BpeTrainer(vocab_size=40,
                                                                                  special_tokens=["[UNK]"]))
    tok.save(str(path))
    return path


def test_a_tokenizer_path_planted_in_meta_json_is_not_copied(step, tmp_path, capsys):
    secret = _secret(tmp_path)
    edit_meta(step, config__train__tokenizer=str(secret))
    out = tmp_path / "hf"
    assert main(["export", str(step), "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "train.tokenizer" in err and "--tokenizer" in err
    assert not _holds_secret(out) and not (out / "model.safetensors").exists()  # refused before anything is written
    for argv in (["generate", str(step), "--prompt", "x", "--max-new-tokens", "1"],):
        assert main(argv) == 2 and "--tokenizer" in capsys.readouterr().err
    # named by the user, a tokenizer is read, parsed and written from what was parsed; a file that is none is refused
    assert main(["export", str(step), "--hf", str(out), "--tokenizer", str(secret)]) == 2
    assert "tokenizer" in capsys.readouterr().err and not _holds_secret(out)
    tok = _tokenizer_file(tmp_path / "tok.json")
    assert main(["export", str(step), "--hf", str(out), "--tokenizer", str(tok)]) == 0
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab() == Tokenizer.from_file(str(tok)).get_vocab()


def test_a_source_directorys_tokenizer_link_is_read_as_a_tokenizer_not_copied(step, tmp_path):
    first = export_hf(step, tmp_path / "hf1")
    (first / "tokenizer.json").unlink()
    (first / "tokenizer.json").symlink_to(_secret(tmp_path))
    with pytest.raises(ValueError, match="tokenizer"):
        export_hf(first, tmp_path / "hf2")
    assert not _holds_secret(tmp_path / "hf2")


def test_export_never_writes_through_links_and_removes_a_stale_index(step, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    outside_link, outside_hard = tmp_path / "target_of_link.txt", tmp_path / "target_of_hard_link.txt"
    outside_link.write_text("keep me (link)")
    outside_hard.write_text("keep me (hard link)")
    (out / "config.json").symlink_to(outside_link)
    os.link(outside_hard, out / "tokenizer.json")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"transformer.wte.weight": '
                                                      '"model-00001-of-00002.safetensors"}}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old weights")
    export_hf(step, out)
    assert outside_link.read_text() == "keep me (link)" and outside_hard.read_text() == "keep me (hard link)"
    for name in ("config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"):
        st = (out / name).lstat()
        assert not (out / name).is_symlink() and st.st_nlink == 1, name
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / "model-00001-of-00002.safetensors").exists()
    # our loader reads the new weights (it would prefer an index)
    from megatronapp.model.hf import load_hf_model
    from megatronapp.train.consolidate import consolidate

    _, model = load_hf_model(out)
    _, state = consolidate(step)
    torch.testing.assert_close(model.embedding.word.weight[:256], state["embedding.word.weight"])


def test_scan_simulate_replaces_a_linked_ground_truth(tmp_path):
    from megatronapp.scan.synth.simulate import simulate

    out = tmp_path / "sim"
    out.mkdir()
    target, hard = tmp_path / "elsewhere.json", tmp_path / "hard.json"
    target.write_text("keep")
    hard.write_text("keep too")
    (out / "ground_truth.json").symlink_to(target)
    simulate(out, ranks=4, tp=2, pp=2, iterations=2)
    assert target.read_text() == "keep" and not (out / "ground_truth.json").is_symlink()
    (out / "ground_truth.json").unlink()
    os.link(hard, out / "ground_truth.json")
    simulate(out, ranks=4, tp=2, pp=2, iterations=2)
    assert hard.read_text() == "keep too" and (out / "ground_truth.json").stat().st_nlink == 1


@pytest.mark.parametrize("world", [2, 0, -1, "abc", True])
def test_a_world_size_that_is_not_the_layout_is_refused(step, tmp_path, capsys, world):
    edit_meta(step, world_size=world)
    out = tmp_path / "hf"
    assert main(["export", str(step), "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "world_size" in err and "meta.json" in err and "Traceback" not in err
    assert not (out / "model.safetensors").exists()


def test_a_checkpoint_that_is_not_whole_is_refused_naming_the_file(step, tmp_path):
    # a layout of two TP ranks whose second rank file is a copy of the first: TP rank 1 is held by nobody
    edit_meta(step, world_size=2, config__parallel__tp=2)
    shutil.copy(step / "rank00000.pt", step / "rank00001.pt")
    edit_meta(step, files=None)  # the forger drops the checksums that would give the copy away
    with pytest.raises(ckpt.CheckpointError, match="tp=1 of data-parallel replica 0; the checkpoint is not whole"):
        export_hf(step, tmp_path / "a")
    (step / "rank00001.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="rank00001.pt missing of its 2 rank files"):
        export_hf(step, tmp_path / "b")


def _forge_rank(step: Path, change) -> None:
    state = torch.load(step / "rank00000.pt", weights_only=True)
    torch.save(change(state), step / "rank00000.pt")
    edit_meta(step, files=None)


@pytest.mark.parametrize("what, change, match", [
    ("coord", lambda s: {**s, "coord": "x"}, "'coord'"),
    ("qkv", lambda s: {**s, "chunks": [{**s["chunks"][0], "layers.0.attn.qkv.weight": torch.zeros(5, 7)}]},
     "layers.0.attn.qkv.weight has shape"),
    ("missing", lambda s: {**s, "chunks": [{k: v for k, v in s["chunks"][0].items() if "layers.1." not in k}]},
     "missing"),
    ("chunks", lambda s: {**s, "chunks": "x"}, "'chunks'"),
])
def test_forged_rank_files_get_errors_naming_the_file(step, tmp_path, what, change, match):
    _forge_rank(step, change)
    with pytest.raises(ckpt.CheckpointError, match=match):
        export_hf(step, tmp_path / "hf")


@pytest.mark.parametrize("meta, match", [
    ({"step": 1, "world_size": 1}, "no 'config' object"),
    (b"[" * 50_000 + b"]" * 50_000, "unreadable"),
    ({"step": 1, "world_size": 1, "config": {"model": {"num_heads": 0}}}, "model.num_heads=0"),
    ({"step": 1, "world_size": 1, "config": {"model": {"hidden_size": -128}}}, "model.hidden_size=-128"),
])
def test_a_forged_meta_json_is_a_clear_error(step, tmp_path, capsys, meta, match):
    from tests.forge import write_meta

    write_meta(step, meta)
    assert main(["export", str(step), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err[-2000:]


def test_a_deeply_nested_marker_is_a_clear_error(step):
    (step / ckpt.MARKER).write_bytes(b"[" * 50_000 + b"]" * 50_000)
    # an unreadable marker holds no checksum (an older format): the meta.json is still read, no RecursionError
    assert ckpt.load_meta(step)["world_size"] == 1
