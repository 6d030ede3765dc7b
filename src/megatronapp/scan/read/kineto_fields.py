"""The fields of a PyTorch profiler (Kineto) trace that name a collective: sizes, process groups, sequence numbers.

Shared by the CPU reader (kineto.py) and the GPU reader (gpu_kineto.py). What PyTorch writes (torch/csrc/profiler
util.cpp `saveNcclMeta`, copied by Kineto onto the NCCL kernel): `Collective name`, `dtype`, `In msg nelems`,
`Out msg nelems`, `Group size`, `Process Group Name` (an id: "0", "1", ...), `Process Group Description`
(`default_pg`, `undefined`, or what the job passed as group_desc), `Process Group Ranks` (a string; past 30 ranks
cut to the first 29, "...", the last), `Global rank start` / `Global rank stride` (where the group is evenly
spaced), `Rank`, `Src Rank` / `Dst Rank` (global ranks, point-to-point only) and `Seq` (the group's sequence
number, recent PyTorch). Every value is checked as data: a field of the wrong type is absent."""
from __future__ import annotations

import json
import re

import numpy as np

from megatronapp.scan.read.format import MAX_WORLD

STEP = re.compile(r"^ProfilerStep#(\d+)$")
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
SEQ_STRIDE = 1_000_000  # instance number = step * stride + order in the step (where the trace has no Seq)
_UNNAMED = ("", "undefined")  # a description that says nothing: groups keep a generic name


class KinetoError(ValueError):
    """A file that is not a usable profiler trace (named in the message)."""


def as_int(v: object) -> int | None:
    """An integer field (ints, or strings of digits as some Kineto versions write them); None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if abs(v) < 1 << 62 else None  # past int64: no count or id of a real trace
    if isinstance(v, str) and re.fullmatch(r"-?\d{1,18}", v.strip()):
        return int(v)
    return None


def nbytes(args: dict) -> int:
    """Payload bytes from a collective's args: element count x dtype size (NCCL args), else the input dims."""
    n = args.get("In msg nelems")
    size = DTYPE_BYTES.get(str(args.get("dtype", "float")).lower(), 4)
    if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 <= n < 1 << 50:  # NaN and 1e300 fail too
        return int(n) * size
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and all(isinstance(x, int) for x in dims[0]):
        t = types[0] if isinstance(types, list) and types else "float"
        return int(np.prod(dims[0], dtype=np.int64)) * DTYPE_BYTES.get(str(t).lower(), 4)
    return 0


def rank_list(v: object, size: int | None = None, start: int | None = None,
              stride: int | None = None) -> tuple[int, ...] | None:
    """Member ranks from `Process Group Ranks` (a list or its string); a list cut short ("[0, 1, ..., 63]") is
    rebuilt from the group's start, stride and size where those say it is evenly spaced, else it is unknown."""
    if isinstance(v, str):
        cut = "..." in v
        try:
            v = json.loads(v.replace("...,", "").replace(", ...", "")) if cut else json.loads(v)
        except json.JSONDecodeError:
            return None
        if cut:
            if start is None or stride is None or size is None or stride <= 0 or size <= 0:
                return None
            full = tuple(range(start, start + stride * size, stride))
            return full if isinstance(v, list) and v and v[0] == full[0] and v[-1] == full[-1] else None
    if isinstance(v, list) and v and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_WORLD
                                         for r in v):
        return tuple(v)
    return None


def pg_configs(info: dict) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """{process group name: (description, member ranks or None)} from a trace's `distributedInfo.pg_config`."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for pg in info.get("pg_config") or []:
        if not isinstance(pg, dict) or "pg_name" not in pg:
            continue
        size = as_int(pg.get("pg_size"))
        out[str(pg["pg_name"])] = (str(pg.get("pg_desc") or ""), rank_list(pg.get("ranks"), size))
    return out


def group_of(args: dict, pgs: dict[str, tuple[str, tuple[int, ...] | None]], label_by_desc: bool = False
             ) -> tuple[str, tuple[int, ...]] | None:
    """(group name, member ranks) of a collective: its args, else the trace's process group config, else the
    trace's only process group. `label_by_desc`: name it by its description (one name for every group of a kind,
    as `DATA_PARALLEL_GROUP`), so groups doing the same job are compared with each other; else `pg<name>`."""
    name = args.get("Process Group Name")
    name = str(name) if isinstance(name, (str, int)) and not isinstance(name, bool) else None
    size, start, stride = (as_int(args.get(k)) for k in ("Group size", "Global rank start", "Global rank stride"))
    ranks = rank_list(args.get("Process Group Ranks"), size, start, stride)
    desc = args.get("Process Group Description")
    if name is not None and name in pgs:
        desc = desc if isinstance(desc, str) else pgs[name][0]
        ranks = ranks or pgs[name][1]
    if name is None and len(pgs) == 1:
        (name, (desc, ranks)), = pgs.items()
    if name is None or not ranks:
        return None  # several groups and no name: counted as communication, matched with nothing
    if label_by_desc and desc != "default_pg":  # the world group is the only one of its kind: its own name
        return (desc if isinstance(desc, str) and desc not in _UNNAMED else "pg"), ranks
    return f"pg{name}", ranks
