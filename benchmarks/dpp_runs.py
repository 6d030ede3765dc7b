"""What the two real-rank MegaDPP benchmarks share (bench_dpp_real on CPU-bound ranks, bench_dpp_emulated on
emulated devices): the dynamic policies' memory cap, a pipeline message's bytes and the modelled wire speed, the
injected wire faults as the simulator's link model, and the executor's own time window."""
from __future__ import annotations

import time
from typing import Any

from megatronapp.dpp.policies import default_target
from megatronapp.pipeline.tasks import StageView


def dpp_cap(size: dict[str, int]) -> int:
    """Interleaved 1F1B's peak activations (stage 0): the dynamic policies get the same memory."""
    return default_target(StageView(stage=0, pp=size["pp"], vpp=size["vpp"], microbatches=size["microbatches"]))


def act_bytes(size: dict[str, Any]) -> int:
    """Bytes of one pipeline message: a microbatch of one sample's activation (fp32) and the 16-byte header."""
    return size["seq"] * size["hidden"] * 4 + 16


def wire_gbps(size: dict[str, Any]) -> float:
    """The modelled wire speed at which one activation takes `wire_ms`."""
    return act_bytes(size) / (size["wire_ms"] / 1e3) / 1e9


def link_model(specs: list[str], size: dict[str, Any]) -> dict[str, Any]:
    """The injected wire faults as SimConfig fields: per-link late delivery (entry s: stages s and s+1) and link
    jitter; {} when the case has none. Ranks are stages here (tp = dp = 1)."""
    from megatronapp import faults

    pp, nominal = size["pp"], size["wire_ms"] / 1e3
    extra, sigma = [0.0] * pp, None
    for f in map(faults.parse, specs):
        if f.kind not in ("slow-wire", "jitter"):
            continue
        a, b = f.ranks
        link = a if b == (a + 1) % pp else b
        if f.kind == "slow-wire":
            extra[link] += (f.factor - 1.0) * nominal
        else:
            extra[link] += nominal
            sigma = f.sigma  # the simulator has one link-jitter law: these cases jitter every link alike
    if not any(extra):
        return {}
    return {"link_latency": extra, "latency": 0.0, "link_jitter": f"lognormal:{sigma}" if sigma else "none"}


def time_executor(trainers: Any, windows: list[float]) -> None:
    """Wrap each trainer's `executor.step` so that it appends its wall seconds to `windows`: the pipeline part of
    a step (first task to last), without the data, the optimizer and the fences around it."""
    for tr in trainers:
        def timed(*a: Any, _inner: Any = tr.executor.step, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                windows.append(time.perf_counter() - t0)
        tr.executor.step = timed
