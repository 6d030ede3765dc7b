"""The fields of a PyTorch profiler (Kineto) trace that name a collective: sizes, process groups, sequence numbers.

Shared by the CPU reader (kineto.py) and the GPU reader (gpu_kineto.py). What PyTorch writes (torch/csrc/profiler
util.cpp `saveNcclMeta`, copied by Kineto onto the NCCL kernel): `Collective name`, `dtype`, `In msg nelems`,
`Out msg nelems`, `Group size`, `Process Group Name` (an id: "0", "1", ...), `Process Group Description`
(`default_pg`, `undefined`, or what the job passed as group_desc), `Process Group Ranks` (a string; past 30 ranks
cut to the first 29, "...", the last), `Global rank start` / `Global rank stride` (where the group is evenly
spaced), `Rank`, `Src Rank` / `Dst Rank` (global ranks, point-to-point only) and `Seq` (the group's sequence
number, recent PyTorch). Every value is checked as data, with one bound for both readers: a field of the wrong
type, or group ranks outside the world, are absent; a number of the right type out of range (a time or duration
not finite or past 2^52 µs, a step number past 2^31 - 1, a `Seq`, element count or dims product past 2^48) is a
KinetoError naming the rank, the file and the field (`bad_event`): that rank is skipped, the rest are read."""
from __future__ import annotations

import json
import re
from pathlib import Path

from megatronapp.files import short
from megatronapp.scan.read.format import MAX_WORLD
from megatronapp.scan.read.kineto_load import KinetoError, is_int

STEP = re.compile(r"^ProfilerStep#(\d+)$")
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
SEQ_STRIDE = 1_000_000  # instance number = step * stride + order in the step (where the trace has no Seq)
MAX_US = float(1 << 52)  # µs (142 years): no profiler's time or duration; in ns it fits int64 with room
MAX_STEP = (1 << 31) - 1  # iteration numbers are int32 columns
MAX_COUNT = 1 << 48  # elements or bytes of one collective, and sequence numbers
NAME_CHARS = 120  # process group names and descriptions, collective names: cut here
_RANKS_CHARS = 1 << 24  # a `Process Group Ranks` string parsed at most this long (2^20 ranks fit)
_UNNAMED = ("", "undefined")  # a description that says nothing: groups keep a generic name

__all__ = ["DTYPE_BYTES", "KinetoError", "MAX_COUNT", "MAX_STEP", "MAX_US", "NAME_CHARS", "SEQ_STRIDE", "STEP",
           "as_int", "bad_event", "check_times", "group_of", "nbytes", "pg_configs", "rank_list", "seq_of",
           "step_number"]


def bad_event(rank: int, path: Path, e: dict, field: str) -> KinetoError:
    """The error for an event out of range: the rank, the file and the field."""
    return KinetoError(f"rank {rank}: {path.name}: an event ({short(e.get('name'), 60)!r}) has {field}; the rank "
                       "is skipped")


def check_times(rank: int, path: Path, e: dict) -> None:
    """KinetoError unless the event's `ts` and `dur` (numbers, `dur` >= 0) are finite and below MAX_US."""
    if not -MAX_US < e["ts"] < MAX_US:  # NaN, Infinity and 1e17 fail here
        raise bad_event(rank, path, e, f"'ts' = {short(e['ts'], 30)}: not a time in µs")
    if not e["dur"] < MAX_US:
        raise bad_event(rank, path, e, f"'dur' = {short(e['dur'], 30)}: not a duration in µs")


def step_number(rank: int, path: Path, e: dict) -> int | None:
    """N of a `ProfilerStep#N` annotation (None for any other event); KinetoError past MAX_STEP."""
    m = STEP.match(e["name"])
    if not m or e.get("cat") not in ("user_annotation", "cpu_op"):
        return None
    if len(m.group(1)) > 10 or int(m.group(1)) > MAX_STEP:
        raise bad_event(rank, path, e, f"a step number above {MAX_STEP}")
    return int(m.group(1))


def as_int(v: object) -> int | None:
    """An integer field (ints, or strings of digits as some Kineto versions write them); None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if abs(v) < 1 << 62 else None  # past int64: no count or id of a real trace
    if isinstance(v, str) and re.fullmatch(r"-?\d{1,18}", v.strip()):
        return int(v)
    return None


def seq_of(args: dict) -> int:
    """The `Seq` of a collective's args, -1 where absent or not an integer; KinetoError where it is one out of
    range (a negative or one past MAX_COUNT: no sequence number)."""
    v = args.get("Seq")
    s = v if is_int(v) else as_int(v)
    if s is None:
        return -1
    if not 0 <= s < MAX_COUNT:
        raise KinetoError(f"args 'Seq' = {short(v, 30)}: not a sequence number")
    return s


def _product(dims: list[int]) -> int:
    """The product of dims, stopped once past MAX_COUNT (a long list of big dims is no quadratic bignum)."""
    if 0 in dims:
        return 0
    n = 1
    for x in dims:
        n *= x
        if not 0 <= n < MAX_COUNT:
            raise KinetoError(f"args 'Input Dims' = {short(dims, 60)}")
    return n


def nbytes(args: dict) -> int:
    """Payload bytes from a collective's args: element count x dtype size (NCCL args), else the input dims
    (KinetoError past MAX_COUNT: a count no collective has)."""
    n = args.get("In msg nelems")
    size = DTYPE_BYTES.get(str(args.get("dtype", "float"))[:20].lower(), 4)
    if isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0:
        if not n < MAX_COUNT:  # NaN is not >= 0; infinity and 1e30 stop here
            raise KinetoError(f"args 'In msg nelems' = {short(n, 30)}")
        return int(n) * size
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and all(is_int(x) for x in dims[0]):
        t = types[0] if isinstance(types, list) and types else "float"
        return _product(dims[0]) * DTYPE_BYTES.get(str(t)[:20].lower(), 4)
    return 0


def rank_list(v: object, size: int | None = None, start: int | None = None, stride: int | None = None,
              world: int = MAX_WORLD) -> tuple[int, ...] | None:
    """Member ranks from `Process Group Ranks` (a list or its string), each a rank of the world (else unknown); a
    list cut short ("[0, 1, ..., 63]") is rebuilt from the group's start, stride and size where those say it is
    evenly spaced inside the world, else it is unknown."""
    if isinstance(v, str):
        cut = "..." in v
        try:
            v = v[:_RANKS_CHARS]
            v = json.loads(v.replace("...,", "").replace(", ...", "")) if cut else json.loads(v)
        except (json.JSONDecodeError, RecursionError):
            return None
        if cut:
            if start is None or stride is None or size is None or stride <= 0 or size <= 0 or start < 0 or \
                    start + stride * (size - 1) >= world:  # checked before the range is built
                return None
            full = tuple(range(start, start + stride * size, stride))
            return full if isinstance(v, list) and v and v[0] == full[0] and v[-1] == full[-1] else None
    if isinstance(v, list) and v and all(is_int(r) and 0 <= r < world for r in v):
        return tuple(v)
    return None


def pg_configs(info: dict, world: int = MAX_WORLD) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """{process group name: (description, member ranks or None)} from a trace's `distributedInfo.pg_config`."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    configs = info.get("pg_config")
    for pg in configs if isinstance(configs, list) else []:
        if not isinstance(pg, dict) or "pg_name" not in pg:
            continue
        size = as_int(pg.get("pg_size"))
        out[str(pg["pg_name"])[:NAME_CHARS]] = (str(pg.get("pg_desc") or "")[:NAME_CHARS],
                                                rank_list(pg.get("ranks"), size, world=world))
    return out


def group_of(args: dict, pgs: dict[str, tuple[str, tuple[int, ...] | None]], label_by_desc: bool = False,
             world: int = MAX_WORLD) -> tuple[str, tuple[int, ...]] | None:
    """(group name, member ranks) of a collective: its args, else the trace's process group config, else the
    trace's only process group. `label_by_desc`: name it by its description (one name for every group of a kind,
    as `DATA_PARALLEL_GROUP`), so groups doing the same job are compared with each other; else `pg<name>`."""
    name = args.get("Process Group Name")
    name = str(name)[:NAME_CHARS] if isinstance(name, (str, int)) and not isinstance(name, bool) else None
    size, start, stride = (as_int(args.get(k)) for k in ("Group size", "Global rank start", "Global rank stride"))
    ranks = rank_list(args.get("Process Group Ranks"), size, start, stride, world)
    desc = args.get("Process Group Description")
    desc = desc[:NAME_CHARS] if isinstance(desc, str) else None
    if name is not None and name in pgs:
        desc = desc if desc is not None else pgs[name][0]
        ranks = ranks or pgs[name][1]
    if name is None and len(pgs) == 1:
        (name, (desc, ranks)), = pgs.items()
    if name is None or not ranks:
        return None  # several groups and no name: counted as communication, matched with nothing
    if label_by_desc and desc != "default_pg":  # the world group is the only one of its kind: its own name
        return (desc if desc is not None and desc not in _UNNAMED else "pg"), ranks
    return f"pg{name}", ranks
