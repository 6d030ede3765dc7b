"""What every benchmark shares: where results go, launching ranks and collecting their records, the fenced step,
one record of the machine, writing results and their docs sections, and the command-line skeleton.

The statistics (paired ratios, bootstrap and Wilson intervals, verdicts, interval tables) live in
benchmarks/stats.py; this file computes no figure. It imports nothing from another benchmark, so any benchmark
(and any helper module of one) can import it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
T = TypeVar("T")


def results_path(name: str) -> Path:
    """benchmarks/results/<name>.json."""
    return RESULTS / f"{name}.json"


# -- ranks ------------------------------------------------------------------------------------------------------
def report(outdir: str | Path, rank: int, record: Any) -> None:
    """Write this rank's record (plain JSON values) where `collect` finds it; call it from a spawned worker."""
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(record))


def collect(outdir: str | Path) -> list[Any]:
    """The records ranks wrote with `report`, in rank order (a rank that reported nothing is left out)."""
    files = sorted(Path(outdir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def launch(worker: Callable[..., None], world: int, *args: Any, outdir: str | Path | None = None,
           backend: str = "gloo", threads: int = 1) -> list[Any]:
    """Run `worker(rank, world, *args, outdir)` on `world` local rank processes; what they `report`ed, by rank.

    `outdir` (default: a temporary directory, removed after) also holds whatever else the ranks write there."""
    from megatronapp.launch import spawn

    if outdir is not None:
        spawn(worker, world, *args, str(outdir), backend=backend, threads=threads)
        return collect(outdir)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, world, *args, tmp, backend=backend, threads=threads)
        return collect(tmp)


def fenced(step: Callable[[], T]) -> tuple[float, T]:
    """Run `step` between two barriers of the default group: (its wall seconds, its result). The second barrier
    makes the time span the slowest rank, the first starts every rank's clock together."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = step()
    dist.barrier()
    return time.perf_counter() - t0, out


def fenced_cpu(step: Callable[[], T]) -> tuple[float, float, T]:
    """`fenced`, plus the CPU seconds (every thread) all ranks spent in `step`, summed over ranks after the fence.
    CPU time is the work done; unlike wall time it hardly grows when other jobs take the cores."""
    import torch
    import torch.distributed as dist

    def timed() -> tuple[T, torch.Tensor]:
        c0 = time.process_time()
        out = step()
        return out, torch.tensor([time.process_time() - c0], dtype=torch.float64)

    wall, (out, cpu) = fenced(timed)
    dist.all_reduce(cpu)  # outside the timed span
    return wall, float(cpu), out


def rotation(items: list[T], rep: int) -> list[T]:
    """`items` rotated by `rep`: sides that take turns, each first as often as the others, so machine noise and
    a neighbour's after-effects fall on all alike."""
    k = rep % len(items)
    return items[k:] + items[:k]


def paired_runs(sides: list[str], n: int, run: Callable[[str], T], show: Callable[[T], str]) -> list[dict[str, T]]:
    """`n` pairs (or tuples) of `run(side)`, one per side, in `rotation`; each printed as it ends with `show`."""
    runs = []
    for i in range(n):
        pair = {}
        for side in rotation(list(sides), i):
            pair[side] = run(side)
            print(f"pair {i + 1} {side}: {show(pair[side])}", flush=True)
        runs.append(pair)
    return runs


# -- the machine --------------------------------------------------------------------------------------------------
@dataclass
class Clock:
    """A run's start: its wall clock, timestamp and load average, for the records written at its end."""

    t0: float = field(default_factory=time.perf_counter)
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)
    timestamp: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def wall_s(self) -> float:
        """Seconds since the start, to a tenth."""
        return round(time.perf_counter() - self.t0, 1)


def machine(since: Clock | None = None, *, emulated: bool = False, host_share: float | None = None,
            **extra: Any) -> dict[str, Any]:
    """Where and under what load a benchmark ran, one key set for all: platform, processor, cpus, python, torch,
    the load average (1, 5, 15 min) at the start (with `since`) and now, whether the devices were emulated and the
    run's host share (host time over device time, as the benchmark states it: its worst rank, or its median step;
    above 0.5 the host, not the device, set the pace); `extra` adds what a benchmark's setting needs (ranks,
    threads per rank, backend)."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_at_start": list(since.load) if since else None, "load_avg_at_end": list(os.getloadavg()),
            "emulated": emulated, "host_share": host_share, **extra}


def machine_of(result: dict[str, Any]) -> dict[str, Any]:
    """A stored result's machine record; for one stored before that record had every key, the keys it kept at
    the top level (load averages, torch, cpus) are taken from there."""
    m = result.get("machine")
    m = dict(m) if isinstance(m, dict) else {}
    for key in ("load_avg_at_start", "load_avg_at_end", "torch", "cpus"):
        if m.get(key) is None and key in result:
            m[key] = result[key]
    if m.get("load_avg_at_end") is None and isinstance(result.get("load_avg"), list):
        m["load_avg_at_end"] = result["load_avg"]
    return m


# -- results and docs -----------------------------------------------------------------------------------------
def read_result(path: Path) -> dict[str, Any]:
    """A stored result; a clear error naming the file when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no stored result (run the benchmark first)") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})") from None


def write_result(result: dict[str, Any], path: Path) -> None:
    """Write a result as indented JSON, creating benchmarks/results/ if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def save(result: dict[str, Any], path: Path, body: str, *, section: str | None = None, block: str | None = None,
         docs: Path = DOCS) -> None:
    """Write a result and its part of the docs (see `write_docs`)."""
    write_result(result, path)
    write_docs(body, section=section, block=block, docs=docs)
    print(f"wrote {shown(path)} and {shown(docs)}")


def write_docs(body: str, *, section: str | None = None, block: str | None = None, docs: Path = DOCS) -> None:
    """`body` as the docs' section titled `section` ('## ...'), or as the generated block `<!-- block -->` inside
    a hand-written section."""
    if section is not None:
        write_section(docs, section, body)
    if block is not None:
        write_block(docs, block, body)


def shown(path: Path) -> str:
    """A path as a message shows it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def rerender(path: Path, body: Callable[[dict[str, Any]], str], *,
             refresh: Callable[[dict[str, Any]], Any] | None = None, section: str | None = None,
             block: str | None = None, docs: Path = DOCS) -> dict[str, Any]:
    """`--from-json`: the stored result at `path` with its docs part rendered again by `body`, measuring nothing;
    `refresh` first recomputes its derived fields (intervals) in place, and the result is written back."""
    result = read_result(path)
    if refresh is not None:
        refresh(result)
        write_result(result, path)
    write_docs(body(result), section=section, block=block, docs=docs)
    print(f"re-rendered {shown(docs)} from {shown(path)}")
    return result


def write_block(path: Path, tag: str, body: str) -> None:
    """Replace the text between `<!-- tag -->` and `<!-- /tag -->` in a Markdown file (the markers stay).

    For hand-written sections that carry a generated part: the prose around the markers is never touched."""
    text = path.read_text()
    start, end = f"<!-- {tag} -->", f"<!-- /{tag} -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path} has no block {start} ... {end}: add the markers where the block belongs")
    path.write_text(text[:i + len(start)] + "\n" + body.strip("\n") + "\n" + text[j:])


def write_section(path: Path, title: str, body: str) -> None:
    """Replace the section `title` ('## ...') of a Markdown file, or append it; other sections are kept."""
    replace_section(path, title + "\n\n" + body.strip("\n") + "\n")


def replace_section(path: Path, section: str) -> None:
    """Replace (or append) the section whose first line, its '## ' title, `section` starts with."""
    title = section.split("\n", 1)[0]
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(title + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- the command line ---------------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parser(doc: str | None, quick: str = "the smallest run that exercises every path; writes nothing", *,
           from_json: bool = False, blocks: int | None = None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: described by its docstring's first line, with `--quick` (help `quick`),
    and if asked `--from-json` (re-render the docs from the stored result) and `--blocks K` (default `blocks`:
    launches of fresh processes, pooled)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    if from_json:
        ap.add_argument("--from-json", action="store_true",
                        help="re-render the docs from the stored result; measure nothing")
    if blocks is not None:
        ap.add_argument("--blocks", type=_positive, default=blocks,
                        help="independent launches of fresh processes, pooled (>= 1)")
    return ap
