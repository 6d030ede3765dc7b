"""The simulator fed with an emulated run's own costs: what `dpp simulate` predicts for a `--emulate-device` run.

`parallel.device_emulation.cost_tables` gives the device seconds every F, B and W task of a step will sleep --
the same FLOPs, jitter draws, speed factors and `--inject slow-compute` factors as the ranks use -- so the
simulated step and the emulated one differ only by what the simulator leaves out: host time that overruns a
task's device time, real message latency, and the optimizer step (added here from the same cost model).
"""
from __future__ import annotations

from megatronapp.config import RunConfig
from megatronapp.device_spec import parse_spec
from megatronapp.dpp.simulator import SimConfig, SimResult, simulate
from megatronapp.flops import OPTIMIZER_FLOPS_PER_PARAM
from megatronapp.parallel import device_emulation as emu


def schedule_name(cfg: RunConfig) -> str:
    """The simulator's name of cfg's schedule (`dpp` runs are named by policy: dpp-zb, dpp-adaptive, ...)."""
    p = cfg.parallel
    return f"dpp-{p.dpp_policy}" if p.schedule == "dpp" else p.schedule


def slow_stages(cfg: RunConfig) -> dict[int, float]:
    """Stage -> slow-compute factor from cfg.inject (a slow TP rank slows its whole stage)."""
    from megatronapp.faults import parse
    from megatronapp.parallel.topology import coord_of

    p = cfg.parallel
    out: dict[int, float] = {}
    for spec in cfg.inject:
        fault = parse(spec)
        if fault.kind == "slow-compute":
            stage = coord_of(fault.ranks[0], p.tp, p.pp, p.dp).pp
            out[stage] = max(out.get(stage, 1.0), fault.factor)
    return out


def sim_config(cfg: RunConfig, step: int, dp: int = 0, latency: float = 0.0) -> SimConfig:
    """A SimConfig of one step of an emulated run: its shape, its tasks' device seconds, its memory cap."""
    if not cfg.emulate_device:
        raise ValueError("the run has no emulate_device spec: nothing to simulate from")
    spec = parse_spec(cfg.emulate_device)
    p = cfg.parallel
    costs = emu.cost_tables(spec, cfg, step, dp, slow_stages(cfg))
    return SimConfig(pp=p.pp, vpp=p.vpp, microbatches=p.microbatches, latency=latency,
                     max_inflight=p.dpp_max_inflight, task_costs=costs)


def optimizer_seconds(cfg: RunConfig, params_per_stage: list[int]) -> float:
    """Device seconds of the slowest stage's optimizer step (every rank steps after the pipeline drains)."""
    spec = parse_spec(cfg.emulate_device or "")
    slow = slow_stages(cfg)
    return max(OPTIMIZER_FLOPS_PER_PARAM * n * slow.get(s, 1.0) / (spec.rate * emu.stage_speed(spec, cfg, s))
               for s, n in enumerate(params_per_stage))


def predict(cfg: RunConfig, step: int, dp: int = 0, latency: float = 0.0, timeline: bool = False) -> SimResult:
    """The simulated pipeline step `step` of the emulated run `cfg` (the optimizer step not included)."""
    return simulate(schedule_name(cfg), sim_config(cfg, step, dp, latency), timeline=timeline)
