"""The `--emulate-device SPEC` grammar: parsed and checked where the config is validated, in the launching process
before any rank starts (parallel/device_emulation.py runs what it describes).

SPEC is comma-separated KEY=VALUE:
  tflops=T              device rate in TFLOP/s (required), e.g. tflops=0.001
  jitter=lognormal:S    lognormal multiplier per forward and per backward, mean 1, log-sd S (default none)
  speed=RANKS:FACTOR    repeatable: the devices of RANKS run at FACTOR times the rate (0.5: twice as slow);
                        RANKS is one rank (3), a list joined by '+' (1+5) or a range (4-7); a later entry wins
  seed=N                jitter seed, an integer >= 0 (default 0)
  host_share=X          warn when a rank's host time exceeds X of its device time (default 0.5)
e.g. `tflops=0.001,jitter=lognormal:0.5,speed=1:0.5`.

Bounds, so that a spec cannot hang or crash a rank: a range of ranks is kept as its two ends, never expanded, and
must name ranks of the world; with the model known (`check_spec(..., task_flops=)`), one microbatch's forward and
backward on the slowest device may take at most MAX_TASK_S of modelled time (tflops=1e-9 would sleep for hours
per task, tflops=1e-300 past what `time.sleep` accepts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatronapp.errors import ConfigError

SPEC_HELP = ("tflops=T[,jitter=lognormal:S][,speed=RANKS:FACTOR ...][,seed=N][,host_share=X], e.g. "
             "tflops=0.001,jitter=lognormal:0.5,speed=1:0.5")
MAX_TASK_S = 600.0  # modelled seconds of one microbatch's forward and backward: beyond this a run looks hung


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed `--emulate-device` SPEC."""

    tflops: float
    sigma: float = 0.0  # lognormal jitter log-sd; 0: no jitter
    speed: tuple[tuple[int, int, float], ...] = ()  # (first rank, last rank, relative speed), in spec order
    seed: int = 0
    host_share: float = 0.5
    text: str = ""

    def speed_of(self, rank: int) -> float:
        """Relative speed of `rank`'s device (1.0 unless a speed entry names it; the last entry wins)."""
        factor = 1.0
        for lo, hi, f in self.speed:
            if lo <= rank <= hi:
                factor = f
        return factor

    def slowest(self, world_size: int) -> float:
        """The smallest relative speed of ranks 0..world_size-1 (speeds change only where an entry starts or
        ends, so those ranks are enough)."""
        ranks = {0} | {r for lo, hi, _ in self.speed for r in (lo, hi + 1) if r < world_size}
        return min(self.speed_of(r) for r in ranks)

    @property
    def rate(self) -> float:
        """FLOP/s of a nominal device."""
        return self.tflops * 1e12


def _bad(text: str, why: str) -> ConfigError:
    return ConfigError(f"--emulate-device {text!r}: {why}; expected {SPEC_HELP}")


def _number(text: str, key: str, value: str, minimum: float, strict: bool = True) -> float:
    try:
        x = float(value)
    except ValueError:
        raise _bad(text, f"{key} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < minimum or (strict and x == minimum):
        raise _bad(text, f"{key}={value} must be {'>' if strict else '>='} {minimum:g}")
    return x


def _ranks(text: str, part: str) -> list[tuple[int, int]]:
    """The (first, last) rank ranges of RANKS, not expanded (a range may be as long as its text allows)."""
    out = []
    for item in part.split("+"):
        a, dash, b = item.partition("-")
        try:
            lo = int(a)
            hi = int(b) if dash else lo
        except ValueError:
            raise _bad(text, f"speed ranks {part!r}: use one rank (3), a list (1+5) or a range (4-7)") from None
        if lo < 0 or hi < lo:
            raise _bad(text, f"speed ranks {part!r}: ranks must be >= 0 and a range low-high")
        out.append((lo, hi))
    return out


def parse_spec(text: str) -> DeviceSpec:
    """Parse SPEC (see the module docstring); raise ConfigError naming the bad part and the expected form."""
    if not isinstance(text, str) or not text.strip():
        raise _bad(str(text), "empty spec: give at least tflops=T (leave --emulate-device out to run without "
                              "emulated devices)")
    values: dict[str, Any] = {"speed": []}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or not value:
            raise _bad(text, f"{part!r} is not KEY=VALUE")
        if key in values and key != "speed":
            raise _bad(text, f"{key} given twice")
        if key == "tflops":
            values[key] = _number(text, key, value, 0.0)
        elif key == "jitter":
            law, colon, s = value.partition(":")
            if law == "none" and not colon:
                values[key] = 0.0
            elif law == "lognormal" and colon:
                values[key] = _number(text, "jitter sigma", s, 0.0, strict=False)
            else:
                raise _bad(text, f"jitter={value}: use lognormal:SIGMA or none")
        elif key == "speed":
            ranks, colon, f = value.partition(":")
            if not colon:
                raise _bad(text, f"speed={value}: use RANKS:FACTOR, e.g. speed=1:0.5")
            factor = _number(text, "speed FACTOR", f, 0.0)
            values["speed"] += [(lo, hi, factor) for lo, hi in _ranks(text, ranks)]
        elif key == "seed":
            try:
                values[key] = int(value)
            except ValueError:
                raise _bad(text, f"seed must be an integer, got {value!r}") from None
            if values[key] < 0:  # numpy's generators take no negative seed: it would fail inside every rank
                raise _bad(text, f"seed={value} must be >= 0")
        elif key == "host_share":
            values[key] = _number(text, key, value, 0.0)
        else:
            raise _bad(text, f"unknown key {key!r}")
    if "tflops" not in values:
        raise _bad(text, "tflops=T is required")
    return DeviceSpec(tflops=values["tflops"], sigma=values.get("jitter", 0.0), speed=tuple(values["speed"]),
                      seed=values.get("seed", 0), host_share=values.get("host_share", 0.5), text=text)


def check_spec(text: str, world_size: int, task_flops: float | None = None) -> DeviceSpec:
    """Parse SPEC and check it against the job: its speed entries name ranks of a world of `world_size`, and
    (given `task_flops`, the FLOPs of the longest microbatch task of one rank) no task outlasts MAX_TASK_S."""
    spec = parse_spec(text)
    beyond = [max(lo, world_size) for lo, hi, _ in spec.speed if hi >= world_size]
    if beyond:
        raise _bad(text, f"speed names rank {min(beyond)}, which does not exist in a world of {world_size} "
                         f"(ranks 0..{world_size - 1})")
    if task_flops is not None:
        slowest = spec.slowest(world_size)
        rate = spec.rate * slowest
        seconds = task_flops / rate if rate > 0 else math.inf  # 0: tflops times FACTOR underflowed
        if not seconds <= MAX_TASK_S:
            key = f"tflops={spec.tflops:g}" + (f" with speed FACTOR {slowest:g}" if slowest < 1 else "")
            need = task_flops / (MAX_TASK_S * slowest) / 1e12
            raise _bad(text, f"{key} makes one microbatch's forward and backward last {seconds:.3g} s of modelled "
                             f"device time, over the {MAX_TASK_S:g} s a task may take (the run would look hung); "
                             f"raise tflops to at least {need:.3g}" + (" or the speed FACTOR" if slowest < 1 else ""))
    return spec
