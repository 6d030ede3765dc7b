"""Files from outside read with bounds, files for others written fresh: what every reader and writer shares.

Reading: a file someone else made (a model directory's config.json, a checkpoint's meta.json, a tokenizer) is
data. Its size is checked before it is read, JSON nested past the parser's depth is refused, and a problem is a
`BadFile` naming the file and what is wrong, in a message of bounded length whatever the file holds.

Writing: an output is created new, never written through what is at its path. A temporary of a random name is
created with O_EXCL | O_NOFOLLOW and renamed over the path, so a symlink or a hard link planted there (or left by
`cp -al`) is replaced itself while the file it points to stays as it was.
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

MESSAGE_CHARS = 300  # the most of a library's message or a file's value an error repeats


class BadFile(ValueError):
    """A file that cannot be read as what it should be; the message names the file."""


def short(text: object, limit: int = MESSAGE_CHARS) -> str:
    """`text` cut to `limit` characters for an error message (a 200 MB field is not echoed whole)."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} characters)"


def read_bounded(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of `path`, refused (BadFile) when it is over `max_bytes`; nothing past the limit is read."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise BadFile(f"{p}: {size} bytes, over the {max_bytes} a {what} may have")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise BadFile(f"{p}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:  # grew while read, or a device without a size
        raise BadFile(f"{p}: over the {max_bytes} bytes a {what} may have")
    return data


def parse_json(data: str | bytes, name: str | Path) -> Any:
    """JSON text `data` of the file `name`; BadFile when it is not JSON or nests deeper than the parser recurses
    (its C scanner counts its depth and raises RecursionError cleanly, long before the stack runs out)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise BadFile(f"{name}: JSON nested too deep to read; not a file of this kind") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadFile(f"{name}: not valid JSON ({short(e, 200)})") from None


def read_json(path: str | Path, max_bytes: int, what: str = "JSON file") -> Any:
    """A JSON file read with its size and nesting bounded; BadFile names the file."""
    return parse_json(read_bounded(path, max_bytes, what), path)


def _fresh_temp(path: Path) -> Path:
    """A new empty file beside `path` (random name, O_EXCL | O_NOFOLLOW: nothing planted is opened)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    return tmp


def replace_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Make `path` a new file holding what `write(tmp)` writes to a fresh temporary: the rename replaces a link at
    `path` itself, never the file it points to. The temporary is removed when `write` fails."""
    p = Path(path)
    tmp = _fresh_temp(p)
    try:
        write(tmp)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_exclusive(path: str | Path, data: bytes) -> None:
    """Atomically replace `path` with `data` (see replace_with): a planted file or link is never written through."""
    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    replace_with(path, write)


def memory_budget() -> int | None:
    """Bytes this process may still allocate, as far as it can tell: the least of what its address-space limit
    (RLIMIT_AS) leaves beyond what it maps now, what its cgroup's memory limit leaves, and the machine's available
    memory. None when none of them can be read (not Linux)."""
    import resource

    found: list[int] = []
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        found.append(soft - _kb_field("/proc/self/status", "VmSize") * 1024)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    available = _kb_field("/proc/meminfo", "MemAvailable")
    if available:
        found.append(available * 1024)
    return max(0, min(found)) if found else None


def _kb_field(path: str, field: str) -> int:
    """A `Field:   123 kB` line of a /proc file, in kB (0 when absent)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
