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
        self.queued_s = 0.0  # time spent runnable but waiting for a core (Linux schedstat's run-queue delay)

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass (the test's own work)."""
        self.ns += round(seconds * 1e9)

    def wait_for_core(self, seconds: float) -> None:
        """Let `seconds` pass with this thread runnable but off the CPU (a loaded host)."""
        self.queued_s += seconds
        self.advance(seconds)

    def cpu_wait_s(self) -> float:
        """faults._cpu_wait_s: the run-queue delay so far; it moves only by `wait_for_core`, never by the real host's
        load (a fake clock read beside the real schedstat made a drill's exact span 2.7 ms short on a loaded CI)."""
        return self.queued_s

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
