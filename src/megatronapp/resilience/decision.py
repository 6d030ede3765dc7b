"""The restart decision of a multi-host job: how the driver, which cannot signal remote processes, stops every rank.

The driver (`resilience watch`) writes `<heartbeat dir>/restart-<round>.json` atomically (temporary name, then
rename): `{"round": R, "culprit": RANK, "label": "DP0-PP1-TP0", "reason": "...", "time": T}`. Every rank of round
R polls for that file from its heartbeat thread and, when it holds a valid decision, ends its process with
`RESTART_EXIT_CODE` through `os._exit` (the training thread may be blocked in a collective, so nothing that waits
for it may run). Each host's torchrun agent then sees failed workers and starts a new rendezvous round.

Rounds count the driver's decisions: a worker group that starts after decisions 0..k exist is round k+1 and
obeys only `restart-<k+1>.json`, so an old decision never stops a new round, whatever torchrun's own restart
count on each host says (a host whose workers were restarted because another host's failed does not count it).
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from megatronapp.files import write_exclusive

# EX_TEMPFAIL (sysexits.h): "temporary failure, the user is invited to retry", which is what a restart is; no
# Python error (1), signal death (negative) or argparse error (2) produces it.
RESTART_EXIT_CODE = 75
_NAME = re.compile(r"^restart-(\d+)\.json$")


class DecisionError(ValueError):
    """A decision file that cannot be obeyed: unreadable, not JSON, wrong fields or the wrong round."""


@dataclass(frozen=True)
class Decision:
    round: int
    culprit: int
    label: str
    reason: str


def path(directory: Path, round_: int) -> Path:
    return Path(directory) / f"restart-{round_}.json"


def rounds_decided(directory: Path) -> int:
    """How many decisions the driver has written: the round number of a worker group starting now."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    return sum(1 for n in names if _NAME.match(n))


def write(directory: Path, decision: Decision) -> Path:
    """Write the decision atomically, so a rank never reads half of it."""
    target = path(directory, decision.round)
    write_exclusive(target, json.dumps({"round": decision.round, "culprit": decision.culprit, "label": decision.label,
                                        "reason": decision.reason, "time": time.time()}).encode())
    return target


def read(directory: Path, round_: int) -> Decision | None:
    """The decision for `round_`, None if there is none yet; DecisionError naming the file and what is wrong."""
    p = path(directory, round_)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DecisionError(f"{p}: cannot read it: {e}") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise DecisionError(f"{p}: not valid JSON ({e}); a decision is written whole, by rename") from None
    if not isinstance(raw, dict):
        raise DecisionError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    for key, kind in (("round", int), ("culprit", int), ("reason", str)):
        if not isinstance(raw.get(key), kind) or isinstance(raw.get(key), bool):
            raise DecisionError(f"{p}: field '{key}' must be {kind.__name__}, got {raw.get(key)!r}")
    if raw["round"] != round_:
        raise DecisionError(f"{p}: holds round {raw['round']}, not {round_}")
    return Decision(raw["round"], raw["culprit"], str(raw.get("label", "?")), raw["reason"])
