"""The check every exported checkpoint passes (tests/test_export.py, and the parallel layouts exported where they
are trained: test_training.py, test_distributed_optimizer.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from megatronapp.train.consolidate import load_model

TEXT = "After Monday: 3 + 4 = 7. Caf\u00e9!"


def assert_exported_matches(ckpt: Path, out: Path, text: str = TEXT) -> None:
    """transformers loads the export; its tokenizer gives the run's ids and its logits equal the engine's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatronapp.data.tokenizer import ByteTokenizer

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == ByteTokenizer().encode(text) and tok.decode(ids[0]) == text
    engine = load_model(ckpt).eval()
    with torch.no_grad():
        got, want = model(ids).logits, engine(ids)
    assert got.shape == want.shape and got.shape[-1] == engine.cfg.vocab_size  # no TP padding rows
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
