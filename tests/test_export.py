"""`megatronapp export CKPT --hf OUT` and `megatronapp generate`: a trained model handed to transformers.

Exported logits equal the engine's (the consolidated checkpoint) within 1e-4, with the real vocabulary (no TP
padding) and the same token ids from AutoTokenizer; an export exported again is byte-identical. Checkpoints of
parallel layouts are exported in the tests that train them (tp2 x pp2: test_training.py, dp2 ZeRO-1:
test_distributed_optimizer.py), where no extra process launch is needed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatronapp.cli import main
from megatronapp.config import RunConfig
from megatronapp.train.export import ExportError, export_hf
from megatronapp.train.trainer import Trainer
from tests.engine_cases import base_case
from tests.hf_checks import assert_exported_matches


def _checkpoint(tmp_path: Path, family: str, **over) -> Path:
    # vocab 300 with the byte tokenizer: padded to 384 in the run, 300 rows in the export
    d = base_case(family, **{"model.num_layers": 2, "model.vocab_size": 300, **over})
    d["train"]["out"] = str(tmp_path / "run")
    tr = Trainer(RunConfig.from_dict(d))
    tr.train_step()
    return tr.save()


@pytest.mark.parametrize("family, over", [("gpt2", {"model.tie_embeddings": False}),
                                          ("llama", {"model.bias": True, "model.tie_embeddings": True}),
                                          ("llama", {})])
def test_export_loads_in_transformers_with_equal_logits_and_reexports_identically(tmp_path, family, over):
    from safetensors.torch import load_file

    ckpt = _checkpoint(tmp_path, family, **over)
    out = export_hf(ckpt, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}
    assert_exported_matches(ckpt, out)
    again = export_hf(out, tmp_path / "hf2")  # an exported directory is a valid source (loaded via model/hf.py)
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((again / "config.json").read_text())


def test_cli_export_then_generate_from_checkpoint_and_export_alike(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, "gpt2")
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    assert "AutoModelForCausalLM" in capsys.readouterr().out
    texts = []
    for src in (ckpt, tmp_path / "hf"):
        assert main(["generate", str(src), "--prompt", "After Monday", "--max-new-tokens", "12", "--greedy"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("After Monday") and len(texts[0]) > len("After Monday\n")
    # sampling is reproducible from its seed
    args = ["generate", str(ckpt), "--prompt", "Tom", "--max-new-tokens", "10", "--temperature", "0.9",
            "--top-k", "50", "--top-p", "0.9", "--seed", "5"]
    assert main(args) == 0 and main(args) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second


def test_bad_sources_and_settings_are_named(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "out")]) == 2
    assert "nothing" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
    with pytest.raises(ExportError, match="parallel_block"):
        export_hf(_checkpoint(tmp_path, "gpt2", **{"model.parallel_block": True}), tmp_path / "pb")


def test_top_p_keeps_the_smallest_set_holding_the_mass():
    from megatronapp.scope.generate import _sample
    from megatronapp.scope.protocol import Generate

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    seen = set(_sample(logits, Generate(type="generate", prompts=["x"], top_p=0.7), gen).tolist())
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the third token is never drawn
    assert set(_sample(logits, Generate(type="generate", prompts=["x"], top_p=0.4), gen).tolist()) == {0}
    assert set(_sample(logits, Generate(type="generate", prompts=["x"]), gen).tolist()) == {0, 1, 2, 3}
