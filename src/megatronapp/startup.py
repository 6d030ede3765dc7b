"""A rank's start-up, told as it happens, and the light entry point that lets a listener start before it.

Between a rank's process start and its first training step lie seconds to minutes of work (importing torch and
the model code, building the process groups, which waits for every rank, building the model, reading a
checkpoint). A watcher that only hears from a rank once all of that is done cannot tell a slow start-up from a
rank that was stopped in the middle of it. So the engine names each part as it begins (`phase("process
groups")`), and whoever listens (`on_phase`: the resilience heartbeat) passes it on.

`entry` is what a spawned rank runs when its launcher was given a prelude: it runs the prelude (e.g. "start the
heartbeat") before it imports anything heavy, then imports and runs the rank. This module imports only the
standard library, so the prelude runs within a fraction of a second of the process starting. The prelude and the
target are import paths that the launching code passes itself (`launch.start(prelude=...)`), never read from a
file.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

_listeners: list[Callable[[str], None]] = []
_told: set[int] = set()  # listeners whose error was reported already (once each: phases repeat)


def on_phase(listener: Callable[[str], None]) -> None:
    """Call `listener(what)` whenever this rank begins a part of its start-up."""
    _listeners.append(listener)


def off_phase(listener: Callable[[str], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def phase(what: str) -> None:
    """This rank begins `what` (e.g. "process groups", "model build", "resume"). A listener's error is its own:
    it never stops the start-up it listens to."""
    for listener in list(_listeners):
        try:
            listener(what)
        except Exception as e:  # noqa: BLE001 - a broken listener must not fail the rank; said once on stderr
            if id(listener) not in _told:
                _told.add(id(listener))
                print(f"start-up phase listener {listener!r} failed at {what!r}: {type(e).__name__}: {e} "
                      "(ignored; the rank goes on)", file=sys.stderr)


def resolve(ref: str) -> Any:
    """The object at import path "package.module:attr.attr"."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def ref_of(fn: Callable) -> str:
    """The import path of a module-level function (what `resolve` takes back)."""
    return f"{fn.__module__}:{fn.__qualname__}"


def entry(prelude: str, rank: int, env: dict[str, str], target: str, *args: Any) -> None:
    """A spawned rank's first code: set its environment, run `prelude(rank)` (before any heavy import), then
    `target(rank, *args)` (`launch._entry`)."""
    os.environ.update(env)
    resolve(prelude)(rank)
    phase("imports")
    resolve(target)(rank, *args)
