"""The run loop of one rank: what a run does around its steps, written once for every kind of run.

The engine's trainer (`train/trainer.py`) and MegaFBD (`fbd/run.py`) both drive it, each with a role object
(`RankRole`: the engine's `Trainer`, or MegaFBD's `RankHost` of a backward or forward rank) that says how this
rank trains, evaluates and saves. The loop owns the rest:
  * plug-ins and lifecycle hooks (`train/plugins.py`): attach, step_start/step_end around each step inside
    its trace window, failure and shutdown;
  * on rank 0: metrics.jsonl (every step), TensorBoard, the progress line (every `log_interval` steps and the
    last), records of steps a resumed run repeats marked `replayed`;
  * validation every `eval_interval` steps and at the end (`val_loss`), MFU per step;
  * checkpoints every `save_interval` steps and at the end (each save's stall, `save_stall_s`);
  * the summary (summary.json on rank 0), including the emulated devices' record (`parallel/emulation.py`).

A rank whose step has no loss (`reports_loss` False: a MegaFBD forward rank) fires the hooks with NaN loss,
grad_norm and lr, and neither logs, evaluates nor counts MFU; it still takes part in the summary's collectives,
which run over `role.topo.groups["world"]`: every rank of the job.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megatronapp import tracing
from megatronapp.config import RunConfig
from megatronapp.parallel import comm
from megatronapp.parallel.device_emulation import warning as emulation_warning
from megatronapp.parallel.distributed_optimizer import optimizer_state_bytes
from megatronapp.parallel.emulation import Emulation
from megatronapp.train import plugins
from megatronapp.train.metrics import MetricsLog, Progress, mfu, mfu_denominator, peak_memory_bytes, read_metrics


class RankRole(Protocol):
    """One rank's part in a run, as the loop drives it."""

    cfg: RunConfig
    rank: int
    role: str  # "coupled" (the engine), "backward" or "forward" (MegaFBD): summary.json's `role`
    reports_loss: bool  # this rank's step records carry the step's loss (False: an FBD forward rank)
    step: int  # optimizer steps done
    device: torch.device
    out: Path
    topo: Any  # `topo.groups["world"]` holds every rank of the job
    hooks: plugins.Hooks
    emulation: Emulation
    optimizer: Any  # None on a rank without optimizer state
    save_stalls: list[float]  # seconds each save held up training

    def attach_plugins(self) -> None: ...

    def detach_plugins(self, raise_errors: bool = True) -> None: ...

    def train_step(self) -> dict[str, float]: ...

    def evaluate(self) -> float: ...

    def save(self) -> Path | None: ...

    def finish_saves(self) -> None: ...

    def close(self) -> None: ...


class _Report:
    """What rank 0 writes while the run goes (metrics.jsonl, TensorBoard, the progress line); nothing elsewhere."""

    def __init__(self, role: RankRole, lead: bool, mfu_measured: bool):
        t = role.cfg.train
        self.lead, self.steps, self.log_interval = lead, t.steps, t.log_interval
        self.path = role.out / "metrics.jsonl"
        # Steps this run directory already logged (a run resumed after a failure repeats the steps since its
        # checkpoint): their records are marked `replayed`, so a reader keeps one loss per step.
        self.logged = _logged_steps(self.path) if lead and role.step < t.steps else 0
        self.log = MetricsLog(self.path) if lead else None
        self.progress = Progress(t.steps, enabled=lead and t.progress, mfu_measured=mfu_measured)
        self.tb = None
        if lead and t.tensorboard:
            from megatronapp.train.tensorboard import TensorBoardLog  # imported only with the flag: start-up time

            self.tb = TensorBoardLog(t.tensorboard, resumed_at=role.step)  # a resumed run replaces later steps

    def step(self, rec: dict[str, Any]) -> None:
        if rec["step"] <= self.logged:
            rec["replayed"] = True
        self.logged = max(self.logged, rec["step"])  # a step run again later (a rollback) is marked too
        if not self.lead:
            return
        self.log.log(rec)
        if self.tb is not None:
            self.tb.log(rec)
        if rec["step"] % self.log_interval == 0 or rec["step"] == self.steps:
            self.progress.update(rec["step"], rec["loss"], rec["tokens_per_s"], rec["mfu"], rec["mem_bytes"],
                                 rec["lr"])

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.tb is not None:
            self.tb.close()


@dataclass
class AfterStep:
    """Where a rank stands in the work after its last committed step `step` (its record, if this process ran or
    was handed it): `done` 0: nothing yet; 1: evaluated, logged and announced (step_end); 2: saved too. A
    recovery redoes what not every rank finished, and a newcomer is handed its source's."""

    step: int
    record: dict[str, Any] | None = None
    done: int = 2
    ran_here: bool = True  # False: handed over by a peer (its lead logged it if the metrics file has it)


# A recovery handler (resilience's in-place recovery): called with the error that ended the step and where the
# rank stood; returns where it stands in the new generation of process groups (the same, or a checkpoint's step
# after a rollback), or None when the error is not one it recovers from (the run then fails as without it).
Recover = Callable[[BaseException, AfterStep], "AfterStep | None"]


def run(role: RankRole, world: int, result_path: str | None = None, recover: Recover | None = None,
        resume: AfterStep | None = None) -> dict[str, Any]:
    """Train `role` to `train.steps` with everything around the steps (module docstring); returns the run
    summary, which rank 0 also writes to summary.json (and to `result_path`, for the launcher). With `recover`,
    a failed step goes to it, and the run goes on in the generation it joined; `resume`: this rank joins a run
    in progress where its source stood (a newcomer of in-place recovery)."""
    cfg, t = role.cfg, role.cfg.train
    lead = role.rank == 0
    # the MFU denominator: a vendor peak, or this device's measured matmul rate (only where MFU is counted)
    peak, peak_what, vendor_peak = (mfu_denominator(t.peak_tflops, role.device, t.dtype) if role.reports_loss
                                    else (0.0, "", True))
    report = _Report(role, lead, mfu_measured=not vendor_peak)
    # model FLOPs (6N + attention, forward and backward) of each token, as MFU counts them: a recompute or a
    # MegaFBD forward instance's extra forward is hardware work, not model work. Over the peak of all `world`
    # ranks of the job, forward instances included.
    flops_tok = cfg.model.flops_per_token(t.seq_len)
    tokens_per_step = t.global_batch_size * t.seq_len
    steps = _Steps(role, report, flops_tok, tokens_per_step, peak, world)
    # a run that starts at its last step still writes its final checkpoint, as a resumed run always did
    after = resume or AfterStep(role.step, done=1 if role.step >= t.steps else 2)
    start_step, t_start = role.step, time.perf_counter()
    rejoined = resume is not None
    failed = False
    try:
        role.attach_plugins()  # inside the try: a plug-in that fails to attach still gets the others shut down
        while True:
            try:
                if rejoined:
                    after = _agree(role, after)
                    rejoined = False
                while True:
                    steps.after_step(after)
                    if role.step >= t.steps:
                        break
                    role.hooks.fire("step_start", role.step)
                    with tracing.step(role.step):
                        rec = role.train_step()
                    after = AfterStep(role.step, steps.measured(rec), done=0)
                role.finish_saves()
                wall = time.perf_counter() - t_start
                summary = _summary(role, world, steps.history, tokens_per_step * max(1, role.step - start_step)
                                   / wall, steps.ckpt_dir, peak_what)
                break
            except BaseException as e:
                again = recover(e, after) if recover is not None else None
                if again is None:
                    raise
                after, rejoined = again, True
    except BaseException as e:
        failed = True
        role.hooks.teardown("failure", e, raise_errors=False)  # the run's own error is what propagates
        raise
    finally:
        role.close()  # data workers stop on a normal end and on a failure alike
        role.detach_plugins(raise_errors=not failed)
        report.close()
    if lead:
        _write(role, summary, report.progress, result_path)
    return summary


class _Steps:
    """A rank's per-step bookkeeping around `train_step`: the record's rates, and the work after each step."""

    def __init__(self, role: RankRole, report: _Report, flops_tok: float, tokens_per_step: int, peak: float,
                 world: int):
        self.role, self.report, self.t = role, report, role.cfg.train
        self.flops_tok, self.tokens_per_step, self.peak, self.world = flops_tok, tokens_per_step, peak, world
        self.history: list[dict[str, Any]] = []
        self.ckpt_dir: Path | None = None

    def measured(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The step's record with its step number and, where a loss is reported, rates and memory."""
        role = self.role
        if role.reports_loss:
            tps = self.tokens_per_step / rec["step_time"]
            rec.update(step=role.step, tokens_per_s=tps, mfu=mfu(tps, self.flops_tok, self.peak, self.world),
                       mem_bytes=peak_memory_bytes(role.device))
        else:  # plug-ins reading the engine's record keys get NaN where no loss is computed
            rec.update(loss=math.nan, grad_norm=math.nan, lr=math.nan, step=role.step)
        return rec

    def after_step(self, after: AfterStep) -> None:
        """Finish the work after step `after.step` that is not done: evaluate (a collective), log, step_end; then
        the checkpoint (every `save_interval` steps and at the end)."""
        role, t, step, rec = self.role, self.t, after.step, after.record
        if after.done < 1:
            if role.reports_loss and t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                val = role.evaluate()  # a forward-only pass of the whole pipeline
                if rec is not None:
                    rec["val_loss"] = val
            if rec is not None:
                if role.reports_loss:
                    if after.ran_here or rec["step"] > self.report.logged:
                        self.report.step(rec)
                    self.history.append(rec)
                role.hooks.fire("step_end", step, rec)
            after.done = 1
        if after.done < 2:
            if step == t.steps or (t.save_interval and step % t.save_interval == 0):
                self.ckpt_dir = role.save()  # the final one: None on a rank that holds no state
            after.done = 2


def _agree(role: RankRole, after: AfterStep) -> AfterStep:
    """After joining a new generation: every rank resumes the work after the step where the least advanced rank
    stands (a collective over the job; all must stand after the same step)."""
    v = torch.tensor([after.done, after.step, -after.step], dtype=torch.int64, device=role.device)
    comm.all_reduce(v, role.topo.groups["world"], op="min", label="resume point")
    done, low, high = (int(x) for x in v.tolist())
    if low != -high:
        raise RuntimeError(f"the ranks of a new generation stand after different steps ({low} to {-high}); the "
                           f"step transaction should make that impossible")
    return AfterStep(after.step, after.record, min(done, after.done), after.ran_here)


def _summary(role: RankRole, world: int, history: list[dict[str, Any]], tokens_per_s: float,
             ckpt_dir: Path | None, peak_what: str) -> dict[str, Any]:
    """The run's numbers on this rank; the world collectives (optimizer state, emulation) run on every rank."""
    job = role.topo.groups["world"]
    # the largest optimizer state of any rank (ZeRO-1 divides it by dp)
    held = optimizer_state_bytes(role.optimizer) if role.optimizer is not None else 0
    state_bytes = torch.tensor([float(held)], dtype=torch.float64, device=role.device)
    comm.all_reduce(state_bytes, job, op="max")
    timed = history[1:] or history  # the first step includes warm-up
    summary = {
        "steps": role.step, "role": role.role,
        "first_loss": history[0]["loss"] if history else math.nan,
        "final_loss": history[-1]["loss"] if history else math.nan,
        "mean_step_time_s": sum(h["step_time"] for h in timed) / max(1, len(timed)),
        "tokens_per_s": tokens_per_s,
        "mfu": sum(h["mfu"] for h in timed) / max(1, len(timed)),
        "peak_mem_bytes": max((h["mem_bytes"] for h in history), default=peak_memory_bytes(role.device)),
        "optimizer_state_bytes": int(state_bytes),
        "checkpoint": str(ckpt_dir) if ckpt_dir is not None else None, "out": str(role.out), "world_size": world,
        "losses": [h["loss"] for h in history], "save_stall_s": role.save_stalls, "mfu_denominator": peak_what,
        "emulated": bool(role.cfg.emulate_device),
    }
    evals = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    if evals:
        summary.update(val_loss=evals[-1][1], best_val_loss=min(v for _, v in evals),
                       best_val_step=min(evals, key=lambda e: e[1])[0], val_losses=evals)
    # every rank's host-vs-device record summed into one table (a collective over the job)
    emulation = role.emulation.summary(job, role.rank, world, role.device)
    if emulation is not None:
        summary["emulation"] = emulation
    return summary


_HIDDEN = ("losses", "save_stall_s", "mfu_denominator", "val_losses", "emulation", "role")  # from the done line


def _write(role: RankRole, summary: dict[str, Any], progress: Progress, result_path: str | None) -> None:
    """Rank 0: the done line, summary.json, the loss plot of a run that evaluated, the launcher's result file."""
    shown = {k: v for k, v in summary.items() if k not in _HIDDEN}
    if "emulation" in summary:
        shown["host_share"] = summary["emulation"]["host_share"]
        warn = emulation_warning(summary["emulation"])
        if warn:
            print(f"megatronapp: warning: {warn}", file=sys.stderr)
    progress.close(shown)
    (role.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if "val_losses" in summary:  # both curves, beside metrics.jsonl
        from megatronapp.train.plot import loss_curve

        summary["loss_plot"] = str(loss_curve(role.out / "metrics.jsonl", role.out / "loss.png"))
    if result_path:
        Path(result_path).write_text(json.dumps(summary))


def _logged_steps(path: Path) -> int:
    """The highest step number in an existing metrics file (0 if none)."""
    if not path.is_file():
        return 0
    return max((int(r.get("step", 0)) for r in read_metrics(path)), default=0)
