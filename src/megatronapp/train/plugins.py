"""The plug-in seam: modules attach to a training run by import path, never by an import in the engine.

A plug-in is a callable `plugin(trainer) -> None`, named in the config by an import path `"package.module:name"`
(`"package.module"` alone means `"package.module:plugin"`). Every rank resolves and calls each one after its
`Trainer` is built; the plug-in reads what it needs from the trainer (`cfg`, `topo`, `rank`, `out`, `chunks`) and
registers callbacks with `trainer.hooks.on(event, fn)` for the events below:

  rank_start(trainer)             once, after every plug-in is attached, before the first step
  step_start(step)                before each step; `step` is the number of steps done so far
  step_end(step, record)          after each step; `step` counts it, `record` holds loss, grad_norm, lr, timings
  checkpoint_saved(step, path)    after a checkpoint directory is complete on every rank
  failure(exc)                    when the run raises, before the exception propagates
  shutdown()                      always, last, on success and on failure

Teardown events (failure, shutdown) run in reverse registration order, so a plug-in attached later (which may
rely on an earlier one, e.g. fault drills inside a tracer's spans) is torn down first. Every teardown callback
runs even if another raises. Pipeline schedules that the engine does not own come through the same resolver:
`SCHEDULE_FACTORIES` maps a schedule name to the import path of a factory `f(cfg) -> Policy`.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

from megatronapp.config import ConfigError, RunConfig

EVENTS = ("rank_start", "step_start", "step_end", "checkpoint_saved", "failure", "shutdown")
_TEARDOWN = frozenset({"failure", "shutdown"})

# schedule name -> factory `f(cfg) -> Policy`, for schedules whose policies live in a module
SCHEDULE_FACTORIES: dict[str, str] = {"dpp": "megatronapp.dpp.policies:schedule_policy"}


class Hooks:
    """The lifecycle callbacks of one rank: plug-ins register with `on`, the trainer calls `fire`."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[..., Any]]] = {e: [] for e in EVENTS}

    def on(self, event: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Call `fn` at `event` (one of EVENTS); returns `fn`."""
        if event not in self._callbacks:
            raise ValueError(f"unknown hook event {event!r}; choose one of {', '.join(EVENTS)}")
        if not callable(fn):
            raise TypeError(f"hook for {event!r} must be callable, got {type(fn).__name__}")
        self._callbacks[event].append(fn)
        return fn

    def fire(self, event: str, *args: Any) -> None:
        """Run the callbacks of a step or start event in order; an exception fails the run as any step error."""
        for fn in self._callbacks[event]:
            fn(*args)

    def teardown(self, event: str, *args: Any, raise_errors: bool = True) -> None:
        """Run every `failure` or `shutdown` callback, last registered first, even when some raise.

        The first error is re-raised afterwards if `raise_errors`; otherwise (an exception is already on its way
        out, which must not be masked) errors are printed to stderr."""
        assert event in _TEARDOWN, event
        errors: list[BaseException] = []
        for fn in reversed(self._callbacks[event]):
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 (the other plug-ins must still be torn down)
                errors.append(e)
                if not raise_errors:
                    print(f"megatronapp: {event} hook {_name(fn)} failed: {e!r}", file=sys.stderr)
        if errors and raise_errors:
            raise errors[0]

    def clear(self) -> None:
        """Forget every callback (after shutdown, so a second shutdown is a no-op)."""
        for fns in self._callbacks.values():
            fns.clear()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def resolve(entry: str, what: str = "attach entry") -> Callable[..., Any]:
    """The callable an import path `"module:attr"` names; a ConfigError naming the entry if there is none."""
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"{what} {entry!r}: expected an import path 'package.module:function'")
    module_name, _, attr = entry.strip().partition(":")
    attr = attr or "plugin"
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} {entry!r}: cannot import module {module_name!r} ({e}); check the spelling "
                          "and that the package is installed in this environment") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {entry!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {entry!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def resolve_all(entries: Iterable[str]) -> list[Callable[..., Any]]:
    """Resolve every entry (fails on the first one that does not resolve)."""
    return [resolve(e) for e in entries]


def schedule_factory(schedule: str) -> Callable[[RunConfig], Any] | None:
    """The policy factory of a module-provided schedule, or None for the engine's own static schedules."""
    entry = SCHEDULE_FACTORIES.get(schedule)
    return resolve(entry, f"policy factory of schedule {schedule!r}") if entry else None


def attach(host: Any, entries: Iterable[str]) -> None:
    """Resolve and call every plug-in in order with `host` (a trainer, or a MegaFBD rank), then fire
    `rank_start`."""
    for plugin in resolve_all(entries):
        plugin(host)
    host.hooks.fire("rank_start", host)


def detach(hooks: Hooks, raise_errors: bool = True) -> None:
    """Fire `shutdown` (every plug-in's, even if one fails) and forget the hooks."""
    try:
        hooks.teardown("shutdown", raise_errors=raise_errors)
    finally:
        hooks.clear()
