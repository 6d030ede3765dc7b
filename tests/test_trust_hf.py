"""A Hugging Face directory is data: its config.json's fields are type- and range-checked with errors naming the
file and the field (n_head 0, n_embd -128, n_layer 4.5, rope_scaling "yarn", nesting past the parser), the model
it describes is checked against the tensors the safetensors headers list before anything is allocated (a small
directory claiming 48 layers of 1024 is refused under a 1.5 GB address-space cap, where building it took 2.9 GB),
an index names files of the directory only, and a bad tokenizer.json is an error of bounded length (a huge field
is not echoed whole)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.config import RunConfig
from megatronapp.model import hf
from megatronapp.model.hf import HFCheckpointError, config_from_hf
from megatronapp.train.export import export_hf
from tests.engine_cases import base_case
from tests.memcap import GIB, run_capped


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A small GPT-2 Hugging Face directory (exported from a 2-layer, hidden-32 checkpoint)."""
    from megatronapp.train.trainer import Trainer

    root = tmp_path_factory.mktemp("hf")
    d = base_case("gpt2", **{"model.num_layers": 2})
    d["train"]["out"] = str(root / "run")
    tr = Trainer(RunConfig.from_dict(d))
    tr.train_step()
    return export_hf(tr.save(), root / "hf")


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of `src` whose config.json has `changes` (a value of ... deletes the field)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"n_head": 0}, "'n_head' must be a positive integer"),
    ({"n_embd": -128}, "'n_embd' must be a positive integer"),
    ({"n_layer": 4.5}, "'n_layer' must be a positive integer"),
    ({"n_head": 5}, "not divisible by model.num_heads=5"),
    ({"layer_norm_epsilon": "x"}, "'layer_norm_epsilon' must be a positive number"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
])
def test_config_fields_are_checked_naming_the_file_and_field(hf_dir, tmp_path, capsys, changes, match):
    d = _with_config(hf_dir, tmp_path / "bad", **changes)
    with pytest.raises(HFCheckpointError, match=match) as e:
        config_from_hf(d)
    assert "config.json" in str(e.value)
    for argv in (["export", str(d), "--hf", str(tmp_path / "out")], ["generate", str(d), "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err


def test_llama_rope_scaling_of_another_type_and_deep_nesting_are_clear_errors(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    raw = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 64}
    for rope, match in (("yarn", "'rope_scaling' must be an object"), ({"rope_type": "yarn"}, "rope_type='yarn'"),
                        ({"rope_theta": -1}, "'rope_theta' must be a positive number")):
        (d / "config.json").write_text(json.dumps({**raw, "rope_scaling": rope}))
        with pytest.raises(HFCheckpointError, match=match):
            config_from_hf(d)
    (d / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(HFCheckpointError, match="config.json: JSON nested too deep"):
        config_from_hf(d)


def test_a_config_claiming_more_than_the_tensors_hold_is_refused_before_allocation(hf_dir, tmp_path):
    big = _with_config(hf_dir, tmp_path / "big", n_layer=48, n_embd=1024, n_head=16, n_inner=4096)
    assert sum(f.stat().st_size for f in big.iterdir()) < 4 << 20
    with pytest.raises(HFCheckpointError, match="model.num_layers=48, but the weights are"):
        hf.check_tensors(big, config_from_hf(big))
    # in a child capped at 1.5 GB: building that model would take 2.9 GB
    code = ("from megatronapp.cli import main\n"
            f"rc = main(['export', {str(big)!r}, '--hf', {str(tmp_path / 'out')!r}])\n"
            "print(rc, round(time.monotonic() - t0, 2))\n")
    r = run_capped(code, GIB * 3 // 2)
    assert r.returncode == 0 and r.stdout.split()[0] == "2", r.stderr[-2000:]
    assert "num_layers=48" in r.stderr and "MemoryError" not in r.stderr, r.stderr[-2000:]
    wide = _with_config(hf_dir, tmp_path / "wide", n_embd=64, n_head=4)  # as many tensors, other shapes
    with pytest.raises(HFCheckpointError, match="shape"):
        hf.load_hf_model(wide)


def test_an_index_names_files_of_the_directory_only(hf_dir, tmp_path):
    d = _with_config(hf_dir, tmp_path / "idx")
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": "../outside.safetensors"}}))
    with pytest.raises(HFCheckpointError, match="not the name of a file in this directory"):
        hf.load_hf_model(d)


def test_a_bad_tokenizer_json_is_an_error_of_bounded_length(hf_dir, tmp_path, capsys):
    from megatronapp.data.tokenizer import load_tokenizer

    d = _with_config(hf_dir, tmp_path / "tok")
    (d / "tokenizer.json").write_text(json.dumps({"version": "A" * 5_000_000}))
    with pytest.raises(ValueError, match="tokenizer.json could not be read") as e:
        load_tokenizer(str(d))
    assert len(str(e.value)) < 1000
    assert main(["generate", str(d), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer" in err and len(err) < 2000 and "Traceback" not in err
