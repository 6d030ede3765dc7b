"""The small training jobs the tests share, each spelled once: the engine-level config of the training and
checkpoint tests, the command-line job of the supervised (resilience and trust) tests, and the uninterrupted
baseline a recovered run is compared with (trained once per session by the `uninterrupted` fixture of
tests/conftest.py, whichever files ask for it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.engine_cases import base_case


def train_case(out: Path, **over: Any) -> dict[str, Any]:
    """The training tests' model (4 layers, hidden 64, seq 32, warm-up and clipping) writing to `out`; `over`
    sets 'section.field' keys as in `engine_cases.base_case`."""
    d = base_case("gpt2", **{"model.num_layers": 4, "model.hidden_size": 64, "train.seq_len": 32,
                             "train.lr": 3e-3, "train.warmup_steps": 2, "train.grad_clip": 1.0,
                             "train.peak_tflops": 1.0, **over})
    d["train"]["out"] = str(out)
    return d


def tiny_flags(*layout: str, hidden: int = 64, layers: int = 2) -> list[str]:
    """`megatronapp train` flags of the supervised tests' job: `layout` (ranks, parallelism, steps, saves, ...)
    on a model of a few ms a step (global batch 4 in 2 microbatches of 16 tokens, no progress bar)."""
    return [*layout, "--layers", str(layers), "--hidden", str(hidden), "--global-batch", "4", "--microbatches", "2",
            "--seq-len", "16", "--no-progress", "--peak-tflops", "1"]


# Flags that change when and how a run saves, never what it computes: a baseline does not depend on them.
_SAVING = {"--save-interval": 1, "--async-save": 0}


def baseline_key(flags: list[str]) -> tuple[str, ...]:
    """What decides an uninterrupted run's losses and weights: its flags less the saving ones (without them a run
    saves its last step only, which is what the tests compare)."""
    key, i = [], 0
    while i < len(flags):
        name = flags[i].split("=", 1)[0]
        if name in _SAVING:
            i += 1 + (_SAVING[name] if "=" not in flags[i] else 0)
            continue
        key.append(flags[i])
        i += 1
    return tuple(key)


def train_uninterrupted(flags: list[str], out: Path) -> Path:
    """Train the job of `flags` (`megatronapp train` flags, --nproc included) to `out` without a fault and save
    its last step; `out`."""
    from megatronapp.cli import build_parser, config_from_args
    from megatronapp.train.trainer import train

    train(config_from_args(build_parser().parse_args(["train", *baseline_key(flags), "--out", str(out)])))
    return out


def heartbeats(out: Path) -> dict[int, dict]:
    """The newest heartbeat of each rank of a supervised run in `out` (rank -> beat); a file caught half written
    is skipped."""
    beats = {}
    for f in (out / ".heartbeat").glob("rank*.json"):
        try:
            b = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        beats[b["rank"]] = b
    return beats
