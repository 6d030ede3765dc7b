"""Virtual time for tests of code that reads a clock and sleeps (fault drills, emulated devices, tracer spans).

Patched in as the module's `time` (`monkeypatch.setattr(faults, "time", clock)`) and handed to the tracer as its
clock, it makes every duration exact: a sleep advances the clock at once and the test's own "work" is
`clock.advance(s)`. A test then checks what the code computes (a stretch, a pause, a device time) to the
nanosecond, and no loaded host can make it fail; what only real time can show stays as a lower bound (a sleep is
never shorter than asked), which load cannot break either.
"""
from __future__ import annotations


class FakeClock:
    """A clock that moves only when told to, or when something sleeps on it."""

    def __init__(self, start_ns: int = 1_000_000_000):
        self.ns = start_ns
        self.slept: list[float] = []  # every sleep, in seconds, in order

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass (the test's own work)."""
        self.ns += round(seconds * 1e9)

    def sleep(self, seconds: float) -> None:
        """time.sleep: records the sleep and advances the clock by it."""
        self.slept.append(seconds)
        self.advance(max(seconds, 0.0))

    def monotonic_ns(self) -> int:
        """time.monotonic_ns (the tracer's clock)."""
        return self.ns

    def perf_counter(self) -> float:
        """time.perf_counter, in seconds."""
        return self.ns / 1e9

    monotonic = perf_counter
    thread_time = perf_counter  # the host's CPU time: all of the time passes on this thread
