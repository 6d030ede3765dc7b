"""PyTorch profiler (Kineto) trace files read with bounds: one file's text to a dict (`kineto.py` maps it to spans).

Sizes are checked before memory is spent. A file is read only up to `max_bytes` of text and to what this process
can hold once that text is parsed (EXPANSION times it, against `files.memory_budget()`: the address-space limit,
the cgroup's and the machine's free memory); a `.json.gz` is decompressed in a stream of 1 MB pieces, never asked
for the whole limit at once (which reserves it), so a 2 MB gzip expanding to 2 GB is refused after the first tens
of MB and a 120 KB one reads in a 1 GB container. JSON nested past the parser's depth, a file without
`traceEvents` or `distributedInfo`, and a world outside 1 to `format.MAX_WORLD` ranks (the `.mst` bound) are
refused naming the file. Nothing in a file decides what code runs.
"""
from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from megatronapp.files import memory_budget, short
from megatronapp.scan.read.format import MAX_WORLD

MAX_BYTES = 2 << 30  # a profiler window of one rank is tens to hundreds of MB; past this it is not read
EXPANSION = 8  # bytes of memory per byte of trace JSON once parsed and mapped (measured: ~7 for CPU traces)
SUFFIXES = (".json", ".json.gz")
_CHUNK = 1 << 20  # bytes decompressed at a time


class KinetoError(ValueError):
    """A file that is not a usable profiler trace (named in the message)."""


def kineto_files(trace_dir: str | Path) -> list[Path]:
    """The profiler trace files of a directory (`*.json`, `*.json.gz`), sorted by name."""
    return sorted(p for p in Path(trace_dir).iterdir() if p.is_file() and p.name.endswith(SUFFIXES))


def _limit(max_bytes: int) -> tuple[int, str]:
    """The most bytes of trace text to read now, and why that many."""
    budget = memory_budget()
    if budget is not None and budget // EXPANSION < max_bytes:
        return budget // EXPANSION, (f"the most this process can hold parsed ({EXPANSION} x the text, of its "
                                     f"{budget >> 20} MB of free memory)")
    return max_bytes, "the size limit"


def _read(path: Path, max_bytes: int) -> bytearray:
    """The (decompressed) text of a trace file, read in a stream and refused past the limit: a gzip is never
    asked for limit + 1 bytes at once (that reserves them all), and a bomb stops at the limit."""
    limit, why = _limit(max_bytes)
    size = path.stat().st_size
    if not path.name.endswith(".gz"):
        if size > limit:
            raise KinetoError(f"{path.name}: {size} bytes, above {why} ({limit} bytes); skipped")
        return bytearray(path.read_bytes())
    raw = bytearray()
    with gzip.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if len(raw) + len(chunk) > limit:
                raise KinetoError(f"{path.name}: over {limit} bytes decompressed ({size} compressed), above "
                                  f"{why}; skipped")
            raw += chunk
    return raw


def load(path: Path, max_bytes: int = MAX_BYTES) -> dict:
    """One trace file as a dict, reading at most `max_bytes` (decompressed): bigger files raise KinetoError."""
    try:
        raw = _read(path, max_bytes)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise KinetoError(f"{path.name}: unreadable ({short(e, 200)}); skipped") from e
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KinetoError(f"{path.name}: not JSON ({e.__class__.__name__}: {short(e, 200)}); skipped") from e
    except RecursionError:
        raise KinetoError(f"{path.name}: JSON nested too deep for a profiler trace; skipped") from None
    finally:
        del raw
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise KinetoError(f"{path.name}: no traceEvents list: not a PyTorch profiler trace; skipped")
    info = doc.get("distributedInfo")
    if not isinstance(info, dict) or not is_int(info.get("rank")) or not is_int(info.get("world_size")):
        raise KinetoError(f"{path.name}: no distributedInfo with rank and world_size (profiled outside "
                          "torch.distributed?); skipped")
    if not 0 < info["world_size"] <= MAX_WORLD or not 0 <= info["rank"] < info["world_size"]:
        raise KinetoError(f"{path.name}: distributedInfo claims rank {short(info['rank'], 30)} of world_size "
                          f"{short(info['world_size'], 30)}; a world holds 1 to {MAX_WORLD} ranks; skipped")
    return doc


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
