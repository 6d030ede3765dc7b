"""Checkpoints: one directory per step, one file per rank, a metadata file, and a completion marker written last.

    <out>/checkpoints/step_00000050/rank00000.pt ... meta.json COMPLETE
    <out>/checkpoints/latest          (text: name of the newest complete step directory)

A step is written into a temporary directory (`.step_00000050.<attempt>`, the attempt id every rank of one launch
agreed on at its first save, so files of an earlier attempt at the same step are never in it): every rank writes
its file there and fsyncs it, then rank 0 checks every file on disk against the size and SHA-256 its rank wrote,
writes `meta.json` (with those checksums), the marker (with meta.json's checksum), fsyncs the directory and
renames it into place. A crash at any moment leaves either no `step_N` or a complete one, never a directory
marked complete that holds shards of two saves. A directory without COMPLETE is never loaded.

Files hold tensors and plain values only and are read with `torch.load(weights_only=True)`: loading a checkpoint
from someone else never runs code (the RNG states are stored as tensors and ints for this reason). Each file is
checked against the checksum in `meta.json`; `resolve(..., verify=True)` falls back from a torn or corrupt
newest checkpoint to the previous complete one and says so. `OutLock` refuses two jobs writing one run directory.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import random
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from megatronapp.config import ConfigError

MARKER = "COMPLETE"
META_MAX_BYTES = 64 << 20  # a meta.json holds a config and one checksum per rank: far below this


class CheckpointError(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# The attempt id of a save that one process writes and commits alone (the driver's reshard, tools, tests): drawn
# once per process, so it is unique to this process. Never a launcher's run id (TORCHELASTIC_RUN_ID is `none`
# under static rendezvous and the same across torchrun restarts; a fixed name would meet a crashed attempt's files).
_PROCESS_ATTEMPT = secrets.token_hex(8)


def _run_id() -> str:
    return _PROCESS_ATTEMPT


def temp_dir(root: Path, step: int, attempt: str | None = None) -> Path:
    """The step's temporary directory for save attempt `attempt`: the id every rank of a launch agreed on
    (`trainer.agree_attempt`); None: this process's own attempt id, for a save one process writes alone (several
    ranks must pass their agreed id: without it each would write its own directory and the commit would refuse)."""
    return root / f".{step_dir(root, step).name}.{attempt or _run_id()}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through (checksum without a second read)."""

    def __init__(self, f: BinaryIO, first_write: Callable[[], None] | None = None):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0
        self.first_write = first_write

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.n += len(b)
        written = self.f.write(b)
        if self.first_write is not None:
            call, self.first_write = self.first_write, None
            self.f.flush()  # the partial file is on disk when the drill fires
            call()
        return written


# -- the stages of a save, for fault drills (`faults.py`: kill-save) -------------------------------------------
SAVE_STAGES = {
    "copy": "the background copy into host memory has begun (asynchronous saves)",
    "write": "the rank file is partly written",
    "sum": "the rank file is durable, its .sum side file not yet written",
    "marker": "every rank's .sum is there; the committer (rank 0) has not checked them nor written meta.json",
    "commit": "meta.json and COMPLETE are written in the temporary directory, not yet renamed into place",
}
_stage_listeners: list[Callable[[str, int, int], None]] = []


def on_save_stage(listener: Callable[[str, int, int], None]) -> None:
    """Call `listener(stage, step, rank)` as a save of this process reaches each of SAVE_STAGES."""
    _stage_listeners.append(listener)


def off_save_stage(listener: Callable[[str, int, int], None]) -> None:
    if listener in _stage_listeners:
        _stage_listeners.remove(listener)


def save_stage(stage: str, step: int, rank: int) -> None:
    for listener in list(_stage_listeners):
        listener(stage, step, rank)


def write_durable(obj: Any, path: Path, first_write: Callable[[], None] | None = None) -> dict[str, Any]:
    """torch.save `obj` to `path`, fsync it; returns its size and SHA-256. `first_write` is called once the first
    bytes are in the file (a drill's "partly written")."""
    with open(path, "wb") as f:
        w = _HashingWriter(f, first_write)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.n, "sha256": w.sha.hexdigest()}


# -- RNG state as tensors and ints (a weights_only load accepts nothing else) ----------------------------------
def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        # this rank's own GPU only: a resume may see fewer GPUs (or this rank on another index) than the save did
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, torch.Tensor):
            torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
        else:  # older checkpoints hold every visible GPU's state: restore those of the GPUs still visible
            for i, s in enumerate(cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


# -- saving ------------------------------------------------------------------------------------------------
def save_rank(root: Path, step: int, rank: int, state: dict[str, Any], attempt: str | None = None) -> Path:
    """Write this rank's durable file of checkpoint `step` into the attempt's temporary directory."""
    d = temp_dir(root, step, attempt)
    d.mkdir(parents=True, exist_ok=True)
    path = d / rank_file(rank)
    info = write_durable(state, path, lambda: save_stage("write", step, rank))
    save_stage("sum", step, rank)
    _atomic_write_bytes(d / (path.name + ".sum"), json.dumps(info).encode())
    return path


def finalize(root: Path, step: int, meta: dict[str, Any], keep: int = 0, attempt: str | None = None) -> Path:
    """Rank 0, after every rank saved (the caller waits for them): every file checked on disk against what its
    rank wrote, checksums into meta.json, the marker, then rename the directory into place and point `latest` at
    it. Keeps the newest `keep` steps (0: all)."""
    tmp, final = temp_dir(root, step, attempt), step_dir(root, step)
    save_stage("marker", step, 0)
    files = {}
    for s in sorted(tmp.glob("*.pt.sum")):
        name = s.name.removesuffix(".sum")
        try:
            info = json.loads(s.read_bytes()[:4096])
            ok = (tmp / name).stat().st_size == info["bytes"] and _sha256(tmp / name) == info["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:  # torn on disk, or not the file this .sum was computed for
            raise CheckpointError(f"checkpoint step {step}: {name} on disk does not match the checksum its rank "
                                  f"wrote; not marking it complete")
        files[name] = info
        s.unlink()
    world = int(meta.get("world_size", len(files)))
    missing = [rank_file(r) for r in range(world) if rank_file(r) not in files]
    if missing:
        raise CheckpointError(f"checkpoint step {step}: {', '.join(missing)} were not written; not marking it complete")
    meta_bytes = json.dumps({**meta, "files": files}, indent=2, default=str).encode()
    _atomic_write_bytes(tmp / "meta.json", meta_bytes)
    # the marker seals meta.json as meta.json seals the rank files (older checkpoints hold "ok": not checked)
    _atomic_write_bytes(tmp / MARKER, json.dumps({"meta_sha256": hashlib.sha256(meta_bytes).hexdigest()}).encode())
    fsync_dir(tmp)
    save_stage("commit", step, 0)
    if final.exists():  # a replayed step saved again after a restart: swap, never mix the two
        trash = root / f".trash.{final.name}.{attempt or _run_id()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    _atomic_write_bytes(root / "latest", (final.name + "\n").encode())
    fsync_dir(root)
    _clean(root, keep, attempt)
    return final


def _clean(root: Path, keep: int, attempt: str | None = None) -> None:
    """Remove temporary directories of other (failed) attempts and, with `keep`, all but the newest steps."""
    for d in root.glob(".step_*"):
        if not d.name.endswith("." + (attempt or _run_id())):
            shutil.rmtree(d, ignore_errors=True)
    if keep > 0:
        complete = [d for d in sorted(root.glob("step_*")) if is_complete(d)]
        for d in complete[:-keep]:
            shutil.rmtree(d, ignore_errors=True)


# -- finding and checking ------------------------------------------------------------------------------------
def is_complete(d: Path) -> bool:
    return (d / MARKER).is_file() and (d / "meta.json").is_file()


RANK_NAME = re.compile(r"rank\d{5,}\.pt")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def verify(d: Path) -> str | None:
    """What is wrong with a complete-marked directory (a missing, torn or altered file), or None."""
    try:
        meta = load_meta(d)
    except CheckpointError as e:
        return str(e)
    files = meta.get("files")
    if files is None:  # written before checksums existed: presence only
        world = meta.get("world_size", 0)
        if isinstance(world, bool) or not isinstance(world, int):
            return f"meta.json's world_size={str(world)[:40]!r} is not a number of ranks"
        missing = next((rank_file(r) for r in range(world) if not (d / rank_file(r)).is_file()), None)
        return f"{missing} is missing" if missing else None
    if not isinstance(files, dict) or not all(
            isinstance(i, dict) and isinstance(i.get("bytes"), int) and isinstance(i.get("sha256"), str)
            for i in files.values()):
        return "meta.json's files are not a table of rank files with their bytes and sha256"
    for name, info in files.items():
        p = d / name
        if not RANK_NAME.fullmatch(name) or not p.is_file():  # a name, never a path to elsewhere
            return f"{name[:80]} is missing"
        if p.stat().st_size != info["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, {info['bytes']} were written (torn)"
        if _sha256(p) != info["sha256"]:
            return f"{name} fails its checksum (corrupt)"
    return None


def newest_usable(root: Path, verify_files: bool = True) -> tuple[Path | None, list[str]]:
    """The newest complete (and, with `verify_files`, intact) step directory under `root`, and a note for each
    newer one that was skipped."""
    notes = []
    for d in sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []:
        if not is_complete(d):
            notes.append(f"incomplete, skipped: {d.name}")
            continue
        problem = verify(d) if verify_files else None
        if problem is None:
            return d, notes
        notes.append(f"unusable, skipped: {d.name} ({problem})")
    return None, notes


def resolve(path: str | Path, verify_files: bool = False, warn: bool = True) -> Path:
    """Turn a --resume argument (a step directory, `.../latest`, a checkpoints or run directory) into a
    complete step directory. A named step directory that is incomplete (or, with `verify_files`, corrupt) is
    refused, naming the newest usable one; otherwise newer unusable directories are skipped, with a warning."""
    p = Path(path)
    if p.name == "latest" and p.is_file():
        p = p.parent  # latest means the newest usable one: fall back past a corrupt newest
    if p.name.startswith("step_"):
        if not p.is_dir():
            raise CheckpointError(f"checkpoint {p} does not exist")
        problem = None if is_complete(p) else f"has no {MARKER} marker (its save did not finish)"
        if problem is None and verify_files:
            problem = verify(p)
        if problem is None:
            return p
        newest, _ = newest_usable(p.parent, verify_files)
        hint = f"; the newest usable one is {newest}" if newest else ""
        raise CheckpointError(f"checkpoint {p} {problem}{hint}")
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    newest, notes = newest_usable(root, verify_files)
    if newest is None:
        hint = f" ({'; '.join(notes)})" if notes else ""
        raise CheckpointError(f"no complete checkpoint at {path}{hint}")
    if notes and warn:
        print(f"megatronapp: checkpoint {'; '.join(notes)}; falling back to {newest.name}", file=sys.stderr)
    return newest


def _sealed_sha(d: Path) -> str | None:
    """The checksum of meta.json that the marker holds (None: a marker of an older format, or none)."""
    try:
        sealed = json.loads((d / MARKER).read_bytes()[:4096])
    except (OSError, ValueError, RecursionError):
        return None
    return sealed.get("meta_sha256") if isinstance(sealed, dict) else None


def load_meta(d: Path) -> dict[str, Any]:
    """meta.json of a step directory, checked against the marker's checksum when the marker holds one."""
    path = d / "meta.json"
    try:
        if path.stat().st_size > META_MAX_BYTES:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes, over {META_MAX_BYTES}: not a meta.json")
        data = path.read_bytes()
        sealed = _sealed_sha(d)
        if sealed is not None and hashlib.sha256(data).hexdigest() != sealed:
            raise CheckpointError(f"{path} fails its checksum (altered or corrupt): resume from another step")
        meta = json.loads(data)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable: {str(e)[:200]}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is unreadable: JSON nested too deep for a meta.json") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return meta


def load_rank(d: Path, rank: int) -> dict[str, Any]:
    """This rank's state from a complete directory: checksum-checked, tensors and plain values only."""
    path = d / rank_file(rank)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: was the checkpoint saved with the same world size?")
    data = path.read_bytes()
    files = load_meta(d).get("files")
    expected = files.get(path.name) if isinstance(files, dict) else None
    if expected is not None and hashlib.sha256(data).hexdigest() != (
            expected.get("sha256") if isinstance(expected, dict) else None):
        raise CheckpointError(f"{path} is corrupt or truncated: it fails its checksum; resume from an older step")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for unsafe, truncated or corrupt files
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CheckpointError(f"{path} was refused: it holds objects other than tensors and plain values, and "
                                  f"loading it would run code from the file. Only load checkpoints you trust "
                                  f"with other tools") from None
        raise CheckpointError(f"{path} is corrupt or truncated: {type(e).__name__}: {e}") from None


# -- one writer per run directory ----------------------------------------------------------------------------
class OutLock:
    """An exclusive lock on a run directory for the life of a job (released by the kernel if the job dies)."""

    def __init__(self, out: str | Path):
        self.path = Path(out) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> OutLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"--out {self.path.parent}: another job ({holder}) is writing to this run directory; "
                              f"wait for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> OutLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
