"""Checkpoints: one directory per step, one file per rank, a metadata file, and a completion marker written last.

    <out>/checkpoints/step_00000050/rank00000.pt ... meta.json COMPLETE
    <out>/checkpoints/latest          (text: name of the newest complete step directory)

Every file is written to a temporary name and renamed, so a crash leaves either the old file or the new one.
A directory without COMPLETE is never loaded: `resolve()` skips it and says so.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rank(root: Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's file of checkpoint `step`."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank:05d}.pt"
    _atomic_torch_save(state, path)
    return path


def finalize(root: Path, step: int, meta: dict[str, Any]) -> Path:
    """After every rank saved (the caller barriers first): metadata, then the marker, then `latest`."""
    d = step_dir(root, step)
    _atomic_write_bytes(d / "meta.json", json.dumps(meta, indent=2, default=str).encode())
    _atomic_write_bytes(d / MARKER, b"ok\n")
    _atomic_write_bytes(root / "latest", (d.name + "\n").encode())
    return d


def is_complete(d: Path) -> bool:
    return (d / MARKER).is_file() and (d / "meta.json").is_file()


def _newest_complete(root: Path) -> tuple[Path | None, list[str]]:
    skipped = []
    for d in sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []:
        if is_complete(d):
            return d, skipped
        skipped.append(d.name)
    return None, skipped


def resolve(path: str | Path) -> Path:
    """Turn a --resume argument (a step directory, `.../latest`, a checkpoints or run directory) into a
    complete step directory. A step directory without its marker is refused, naming the newest complete one."""
    p = Path(path)
    if p.name == "latest" and p.is_file():
        p = p.parent / p.read_text().strip()
    if p.name.startswith("step_"):
        if is_complete(p):
            return p
        if not p.is_dir():
            raise CheckpointError(f"checkpoint {p} does not exist")
        newest, _ = _newest_complete(p.parent)
        hint = f"; the newest complete one is {newest}" if newest else ""
        raise CheckpointError(f"checkpoint {p} has no {MARKER} marker (its save did not finish){hint}")
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    newest, skipped = _newest_complete(root)
    if newest is not None:
        return newest
    hint = f" (incomplete, skipped: {', '.join(skipped)})" if skipped else ""
    raise CheckpointError(f"no complete checkpoint at {path}{hint}")


def load_meta(d: Path) -> dict[str, Any]:
    try:
        return json.loads((d / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d / 'meta.json'} is unreadable: {e}") from None


def load_rank(d: Path, rank: int) -> dict[str, Any]:
    path = d / f"rank{rank:05d}.pt"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: was the checkpoint saved with the same world size?")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for truncated or corrupt files
        raise CheckpointError(f"{path} is corrupt or truncated: {type(e).__name__}: {e}") from None
