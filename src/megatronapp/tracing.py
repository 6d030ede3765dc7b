"""The span API every part of the engine uses: `with span(name, cat, **meta):`.

With no sink installed `span()` returns one shared no-op context manager, so the engine pays a function call
and nothing else. Observers (the MegaScan tracer, the fault injector) install a `SpanSink`; spans are opened
in installation order and closed in reverse, so a sink installed later sees its spans nested inside.
Spans of asynchronous work (an `isend` waited on later) may overlap without nesting: sinks must key on the
token they returned, not on a stack.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class SpanSink(Protocol):
    def open(self, name: str, cat: str, meta: dict[str, Any]) -> Any:
        """Start a span; return a token handed back to `close`."""

    def close(self, token: Any) -> None:
        """End the span `token`."""

    def step(self, iteration: int, begin: bool) -> None:
        """An iteration boundary (begin=True at its start, False at its end)."""


_sinks: list[SpanSink] = []


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()


class _Span:
    __slots__ = ("name", "cat", "meta", "tokens")

    def __init__(self, name: str, cat: str, meta: dict[str, Any]):
        self.name, self.cat, self.meta = name, cat, meta
        self.tokens: list[Any] = []

    def __enter__(self) -> _Span:
        self.tokens = [s.open(self.name, self.cat, self.meta) for s in _sinks]
        return self

    def __exit__(self, *exc: object) -> None:
        for s, tok in zip(reversed(_sinks[: len(self.tokens)]), reversed(self.tokens)):
            s.close(tok)


def span(name: str, cat: str, **meta: Any) -> Any:
    """Context manager recording a span when a sink is installed, else a shared no-op."""
    if not _sinks:
        return _NULL
    return _Span(name, cat, meta)


def open_span(name: str, cat: str, **meta: Any) -> Any:
    """Start a span that a later `close_span` ends (for async ops); None when tracing is off."""
    if not _sinks:
        return None
    sp = _Span(name, cat, meta)
    sp.__enter__()
    return sp


def close_span(handle: Any) -> None:
    if handle is not None:
        handle.__exit__(None, None, None)


@contextmanager
def step(iteration: int) -> Iterator[None]:
    """Mark one training iteration; sinks use it for trace windows."""
    for s in _sinks:
        s.step(iteration, True)
    try:
        yield
    finally:
        for s in reversed(_sinks):
            s.step(iteration, False)


def install(sink: SpanSink) -> None:
    _sinks.append(sink)


def uninstall(sink: SpanSink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


def enabled() -> bool:
    return bool(_sinks)
