"""Files forged as an attacker with write access would forge them, for the trust tests: a checkpoint's meta.json
rewritten and sealed again (the marker's checksum), so only the reader's own rules stand between it and the run."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"  # train/checkpoint.py's marker (not imported: a forger needs no torch)


def write_meta(step: Path, meta: Any, reseal: bool = True) -> None:
    """Replace `step`'s meta.json with `meta` (any JSON value, or bytes as they are) and, with `reseal`, the
    marker's checksum of it."""
    data = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    (step / "meta.json").write_bytes(data)
    if reseal:
        (step / MARKER).write_text(json.dumps({"meta_sha256": hashlib.sha256(data).hexdigest()}))


def edit_meta(step: Path, reseal: bool = True, **changes: Any) -> dict:
    """Change meta.json's fields: `world_size=2`, or `config__train__tokenizer="/x"` for a nested one (a value
    of None deletes the field); returns the new meta."""
    meta = json.loads((step / "meta.json").read_text())
    for key, value in changes.items():
        *path, leaf = key.split("__")
        node = meta
        for part in path:
            node = node[part]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    write_meta(step, meta, reseal)
    return meta
