"""The current start of a multi-host job's workers, and the fence that stops the ranks of a replaced one.

torchrun replaces a host without any decision of ours: when a host's rendezvous keep-alive expires (the host
died, or its network was cut) and a standby host waits, the remaining agents restart their workers together with
the standby, as a new start of the same round. The ranks of a host that was only cut off are still alive, blocked
in collectives with peers that are gone. They must not go on as if they were the job: beat for rank numbers that
now live on another host, or save a step beside the job's own (split brain).

So rank 0 of every start writes `<heartbeat dir>/start.json` before any rank trains (the start id is broadcast
only after the write): `{"round", "start", "time", "run_id", "hosts": {node: address}}`. Every rank's heartbeat
thread reads it at each beat (`Fence.check`); a rank whose own start is no longer the current one exits with
`decision.RESTART_EXIT_CODE` without another beat. The file lives where the checkpoints and heartbeats live, so a
rank that can still reach the shared file system sees it; one that cannot write there cannot save a step there
either. A step is committed only after a barrier of every rank of its start (`checkpoint.finalize` needs every
rank's file), which ranks of a start that lost a host cannot pass.

The record also tells the watcher which start is current (instead of the freshest heartbeat: a fenced rank's last
beats may be the freshest for a moment), and when it began.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatronapp.resilience import decision

NAME = "start.json"
MAX_BYTES = 1 << 20  # a few hundred bytes per host; a bigger file is not ours


class StartError(ValueError):
    """A start record that cannot be trusted: unreadable, not JSON, or a field of the wrong type."""


@dataclass(frozen=True)
class Start:
    round: int
    start: str
    time: float
    run_id: str = ""
    hosts: dict[int, str] = field(default_factory=dict)  # torchrun node rank (GROUP_RANK) -> its address


def write(directory: Path, record: Start) -> Path:
    """Make `record` the current start (atomically: a reader never sees half of it)."""
    target = Path(directory) / NAME
    decision.write_exclusive(target, json.dumps({
        "round": record.round, "start": record.start, "time": record.time, "run_id": record.run_id,
        "hosts": {str(k): v for k, v in record.hosts.items()}}).encode())
    return target


def read(directory: Path) -> Start | None:
    """The current start, None if no start was recorded yet; StartError naming the file and the field."""
    p = Path(directory) / NAME
    try:
        data = p.read_bytes()[:MAX_BYTES + 1]
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StartError(f"{p}: cannot read it: {e}") from None
    if len(data) > MAX_BYTES:
        raise StartError(f"{p}: over {MAX_BYTES} bytes; not a start record")
    try:
        raw = json.loads(data)
    except ValueError as e:
        raise StartError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise StartError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    for key, kinds in (("round", (int,)), ("start", (str,)), ("time", (int, float)), ("run_id", (str,)),
                       ("hosts", (dict,))):
        value = raw.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise StartError(f"{p}: field '{key}' has the wrong type ({str(value)[:40]!r})")
    hosts = raw["hosts"]
    if not all(isinstance(k, str) and k.isdigit() and isinstance(v, str) for k, v in hosts.items()):
        raise StartError(f"{p}: field 'hosts' must map node numbers to addresses")
    return Start(raw["round"], raw["start"], float(raw["time"]), raw["run_id"], {int(k): v for k, v in hosts.items()})


class Fence:
    """This rank's start, checked against the current one."""

    def __init__(self, directory: Path, round_: int, start: str):
        self.directory, self.round, self.start = Path(directory), round_, start
        self._reported: str | None = None

    def check(self) -> Start | None:
        """The start that replaced this rank's, or None while this rank's start is current (or the record cannot
        be read: a bad file is reported once and never stops a rank)."""
        try:
            current = read(self.directory)
        except StartError as e:
            if str(e) != self._reported:
                self._reported = str(e)
                print(f"megatronapp heartbeat: ignoring the start record: {e}", file=sys.stderr, flush=True)
            return None
        if current is None or current.start == self.start or current.round < self.round:
            return None
        return current


def describe(current: Start, now: float | None = None) -> str:
    """One line about a start, for a fenced rank's last words."""
    age = (now or time.time()) - current.time
    hosts = ", ".join(f"node {n}: {a}" for n, a in sorted(current.hosts.items()))
    return f"start {current.start} of round {current.round} began {age:.1f} s ago on {hosts or 'unknown hosts'}"

