"""The keys and messages of in-place recovery, in the supervisor's key-value store (a TCPStore on 127.0.0.1).

The supervisor owns the store and the generation number. Every key is data, validated on read (size-bounded
JSON checked by pydantic, or a bounded number); none names a file, a module or a command: a rank that must load a
checkpoint finds it in its own run directory.

  ctl/gen                     the newest generation number (the supervisor's)
  ctl/plan/<g>                `Plan` of generation g (the supervisor's), written before ctl/gen names g
  ctl/end/<g>                 generation g has ended; the value says why (the supervisor's)
  ctl/left/<g>/<rank>         `Left`: the rank left g (its own report, with what it failed on)
  ctl/mark/<g>/<what>/<rank>  when the rank reached a part of joining g (a time.time() float): the benchmark's
                              split of a recovery (`MARKS`)
  ctl/mark/<g>/commit         when g's first commit was decided "commit" (the rank that decided it)
  ctl/votes/<g>/<k>           the k-th commit of g: ranks that finished that step's work before its update
  ctl/outcome/<g>/<k>         "commit <step>" (the rank whose vote made the count whole) or "abort" (the
                              supervisor, when it ends g); whoever sets it first decides (compare_set)
  ctl/committed/<g>           the highest k of g known committed: where the supervisor starts deciding
  ctl/spare/<id>/ready        a warm spare: torch and the trainer imported, waiting
  ctl/spare/<id>/assign       `Assignment`: the spare becomes a rank of a generation
  ctl/buddy/<rank>            ZeRO-1: "<step> <pid>", the step of rank's optimizer slice its buddy (process pid)
                              holds in memory (the buddy's, after each whole copy: `buddy.py`)
The process groups of generation g live under the prefix `gen<g>/` (a `PrefixStore`), so no key of a dead
generation is ever read by a live one.
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_VALUE_BYTES = 64 * 1024
MAX_RANKS = 1 << 20
MARKS = ("left", "plan", "joined", "groups", "state")  # the parts of a recovery, in order, as ranks reach them

GEN = "ctl/gen"


def plan_key(g: int) -> str:
    return f"ctl/plan/{g}"


def end_key(g: int) -> str:
    return f"ctl/end/{g}"


def left_key(g: int, rank: int) -> str:
    return f"ctl/left/{g}/{rank}"


def mark_key(g: int, what: str, rank: int) -> str:
    return f"ctl/mark/{g}/{what}/{rank}"


def first_commit_key(g: int) -> str:
    return f"ctl/mark/{g}/commit"


def votes_key(g: int, k: int) -> str:
    return f"ctl/votes/{g}/{k}"


def outcome_key(g: int, k: int) -> str:
    return f"ctl/outcome/{g}/{k}"


def committed_key(g: int) -> str:
    return f"ctl/committed/{g}"


def spare_ready_key(sid: int) -> str:
    return f"ctl/spare/{sid}/ready"


def spare_assign_key(sid: int) -> str:
    return f"ctl/spare/{sid}/assign"


def prefix(g: int) -> str:
    """The store prefix of generation g's process groups."""
    return f"gen{g}/"


class ProtocolError(ValueError):
    """A store value that is not what the protocol allows; the message names the key."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Plan(_Msg):
    """Generation `generation`: who is in it and where the newcomers' state comes from. `source` "start": every
    rank starts as its config says (the job's first generation); "peer": each newcomer receives its state from a
    survivor at its (pp, tp) in another DP replica; "peer+buddy" (ZeRO-1): the same, and its own optimizer slice
    from the DP peer that keeps a copy of it (`buddy.py`); "disk": every rank loads the newest intact checkpoint of the
    run directory it was started with (memory holds no copy of a lost rank's state)."""

    generation: int = Field(ge=0, lt=1 << 40)
    world: int = Field(ge=1, le=MAX_RANKS)
    newcomers: list[int] = Field(default_factory=list, max_length=4096)
    source: Literal["start", "peer", "peer+buddy", "disk"]
    step: int = Field(ge=-1, lt=1 << 40)  # the committed step the survivors stand after (-1: not known)
    # A member's own backstop while the generation's groups form (its rendezvous waits), set past the supervisor's
    # judgement of the generation: the supervisor, which sees every rank's marks, names the rank that is late; a
    # member that gave up first was blamed for waiting on it (a healthy rank replaced at a loaded start-up).
    form_timeout_s: float = Field(default=30.0, gt=0, le=7 * 86400)


class Assignment(_Msg):
    """A spare's orders: become `rank` in generation `generation`."""

    rank: int = Field(ge=0, lt=MAX_RANKS)
    generation: int = Field(ge=0, lt=1 << 40)


class Left(_Msg):
    """A rank's report that it left generation `generation` after committed step `step`, and why."""

    generation: int = Field(ge=0, lt=1 << 40)
    rank: int = Field(ge=0, lt=MAX_RANKS)
    step: int = Field(ge=0, lt=1 << 40)
    reason: str = Field(max_length=2000)


M = TypeVar("M", bound=_Msg)


def encode(msg: _Msg) -> str:
    return msg.model_dump_json()


def decode(raw: bytes, model: type[M], key: str) -> M:
    """`raw`, the value of `key`, as a `model`; ProtocolError naming the key when it is not one."""
    if len(raw) > MAX_VALUE_BYTES:
        raise ProtocolError(f"store key {key}: {len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        return model.model_validate(json.loads(raw))
    except ValidationError as e:  # name the field and what is wrong with it, not only "1 validation error"
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "(the value)"
        raise ProtocolError(f"store key {key}: not a valid {model.__name__}: {where}: {first['msg']}"[:400]
                            ) from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"store key {key}: not a valid {model.__name__}: {e}".splitlines()[0][:400]) from None


def read(store: Any, key: str, model: type[M]) -> M:
    """The `model` at `key` (waits for it as the store's get does)."""
    return decode(store.get(key), model, key)


def number(raw: bytes, key: str, kind: type = float) -> Any:
    """A bounded number stored as text (a generation, a commit index, a time)."""
    if len(raw) > 64:
        raise ProtocolError(f"store key {key}: {len(raw)} bytes for a number")
    try:
        value = kind(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"store key {key}: {raw[:64]!r} is not a{'n integer' if kind is int else ' number'}"
                            ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"store key {key}: {value} is not finite")
    return value
