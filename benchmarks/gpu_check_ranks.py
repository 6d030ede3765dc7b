"""The `ranks` check of benchmarks/gpu_check.py: the engine's multi-rank paths on NCCL, against gloo on the CPU.

One GPU: several NCCL ranks share it. NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
detected": same host hash and bus id), so each rank gets a host id of its own (`NCCL_HOSTID`, read by NCCL's
`getHostHash`) and, the "hosts" being one, talks over sockets on loopback: P2P, shared memory, InfiniBand and NVLS
off. Every rank then believes it is local rank 0 of its host (benchmarks/gpu_rank.sh). The ranks start under
torchrun, as users start them. A 2-rank NCCL all-reduce probes this first; if NCCL still refuses, the check says so
and skips (SKIP with NCCL's words), since the machine, not the engine, is at fault. The same configurations then
run on gloo on the CPU (the local launcher) and the losses must agree: the first step's (forward only) within
1e-4, later ones within 1e-3 (fp32 without TF32: GPU and CPU kernels sum in different orders, and Adam's
normalised updates carry that on; a layout bug shows as 1e-2 and more).

Several GPUs (`--gpus 8`): each layout, MegaDPP, ZB-H1 and MegaFBD on NCCL against one GPU's run of the same model
and batch; after an async save every process must be on one GPU only (`nvidia-smi --query-compute-apps`); tokens/s
with and without communication overlap are reported.

On the CPU (`--rehearse-on-cpu`) the same path runs with gloo for NCCL (torchrun, the wrapper, the comparison).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from typing import Any

from benchmarks.gpu_check_common import (
    CLI,
    ROOT,
    CheckFailed,
    CheckSkipped,
    Run,
    env,
    expect,
    metrics,
    run_cli,
    run_cmd,
    run_together,
    stop,
    tail,
)

MODEL = ["--model", "llama-tiny", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--layers", "4",
         "--seq-len", "16", "--global-batch", "8", "--microbatches", "4", "--lr", "3e-3", "--warmup", "1",
         "--dtype", "fp32", "--no-tf32", "--data-prefetch", "0", "--no-progress"]
ONE_GPU = {  # name: (ranks, flags)
    "tp2 x pp2, SP, TP overlap, DPP": (4, ["--tp", "2", "--pp", "2", "--sequence-parallel", "--tp-comm-overlap",
                                          "--schedule", "dpp"]),
    "dp2 x pp2 vpp2, ZeRO-1": (4, ["--dp", "2", "--pp", "2", "--vpp", "2", "--schedule", "interleaved-1f1b",
                                   "--zero", "1"]),
}
EIGHT_GPUS = {
    "tp8": (8, ["--tp", "8", "--heads", "8", "--kv-heads", "8", "--sequence-parallel"]),
    "pp8 1f1b": (8, ["--pp", "8", "--layers", "8", "--microbatches", "8"]),
    "dp8": (8, ["--dp", "8", "--microbatches", "1"]),
    "tp2 x pp2 x dp2, SP, TP overlap": (8, ["--tp", "2", "--pp", "2", "--dp", "2", "--sequence-parallel",
                                            "--tp-comm-overlap"]),
    "pp4 vpp2 x dp2, ZeRO-1": (8, ["--pp", "4", "--vpp", "2", "--dp", "2", "--layers", "8",
                                   "--schedule", "interleaved-1f1b", "--zero", "1"]),
    "tp2 x pp2 x dp2, DPP": (8, ["--tp", "2", "--pp", "2", "--dp", "2", "--schedule", "dpp"]),
    "pp4 x dp2, ZB-H1": (8, ["--pp", "4", "--dp", "2", "--schedule", "zb-h1"]),
    "MegaFBD tp2 x pp2 + forward tp2 x pp2": (8, ["--tp", "2", "--pp", "2", "--fbd", "--fbd-forward-tp", "2",
                                                  "--fbd-forward-pp", "2"]),
}
SHAPE_FLAGS = ("--layers", "--heads", "--kv-heads")  # flags of EIGHT_GPUS that change the model, not the layout
NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
            "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"}
FIRST_TOL, LATER_TOL = 1e-4, 1e-3


def torchrun(run: Run, nproc: int, args: list[str], backend: str) -> tuple[list[str], dict[str, str]]:
    """`megatronapp ARGS` on `nproc` ranks under torchrun, each rank a host of its own to NCCL (gpu_rank.sh)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--no-python",
           "bash", str(ROOT / "benchmarks" / "gpu_rank.sh"), sys.executable, "-m", "megatronapp", *args,
           "--backend", backend]
    return cmd, {**NCCL_ENV, "GPU_CHECK_RUN": run.out.name}


def probe_nccl(run: Run) -> None:
    """Two NCCL ranks on one GPU sum a tensor; CheckSkipped with NCCL's own words if it refuses."""
    code = ("import os, torch, torch.distributed as dist; torch.cuda.set_device(0); "
            "dist.init_process_group('nccl', device_id=torch.device('cuda', 0)); "
            "t = torch.ones(4, device='cuda') * (dist.get_rank() + 1); dist.all_reduce(t); "
            "assert t.tolist() == [3.0] * 4, t; dist.destroy_process_group(); print('nccl ok')")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
           "bash", str(ROOT / "benchmarks" / "gpu_rank.sh"), sys.executable, "-c", code]
    try:
        run_cmd(cmd, run.left(120), {**NCCL_ENV, "GPU_CHECK_RUN": "probe"})
    except CheckFailed as e:
        raise CheckSkipped(f"NCCL refused two ranks on one GPU (per-rank NCCL_HOSTID, sockets on loopback), so "
                           f"the multi-rank NCCL paths did not run here:\n{e}") from None


def compare(name: str, got: dict[int, dict], ref: dict[int, dict]) -> float:
    """Largest loss gap between two runs of one configuration; CheckFailed past the tolerances."""
    steps = sorted(ref)
    expect(sorted(got) == steps, f"{name}: steps {sorted(got)} against the reference's {steps}")
    gaps = [abs(got[s]["loss"] - ref[s]["loss"]) for s in steps]
    expect(all(math.isfinite(got[s]["loss"]) for s in steps), f"{name}: non-finite losses")
    first = steps[0]
    expect(gaps[0] <= FIRST_TOL, f"{name}: first-step loss {got[first]['loss']:.6f} vs {ref[first]['loss']:.6f}")
    worst = steps[gaps.index(max(gaps))]
    expect(max(gaps) <= LATER_TOL, f"{name}: losses differ by up to {max(gaps):.2e} (step {worst})")
    return max(gaps)


def one_gpu(run: Run) -> str:
    steps = 3 if run.kind == "cuda" else 2
    backend = "nccl" if run.kind == "cuda" else "gloo"
    if run.kind == "cuda":
        probe_nccl(run)
    configs = dict(list(ONE_GPU.items())[:1]) if run.quick else ONE_GPU
    done, facts = [], {}
    for i, (name, (nproc, flags)) in enumerate(configs.items()):
        dev, cpu = run.out / f"ranks{i}-{backend}", run.out / f"ranks{i}-cpu"
        common = [*MODEL, *flags, "--steps", str(steps)]
        run_together([torchrun(run, nproc, ["train", *common, "--out", str(dev)], backend),
                      ([*CLI, "train", "--nproc", str(nproc), *common, "--backend", "gloo", "--out", str(cpu)], {})],
                     run.left(300))
        gap = compare(name, metrics(dev), metrics(cpu))
        facts[name] = {"max_loss_gap": gap, "losses": [r["loss"] for _, r in sorted(metrics(dev).items())]}
        done.append(f"{name}: {gap:.1e}")
    run.facts["ranks"] = facts
    where = "NCCL ranks sharing one GPU" if run.kind == "cuda" else "gloo under torchrun"
    return f"{where} vs gloo on the CPU, largest loss gaps: " + "; ".join(done)


def _placement() -> dict[str, set[str]]:
    """Which GPUs (uuid) each compute process is on, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60).stdout
    where: dict[str, set[str]] = {}
    for line in out.splitlines():
        pid, _, uuid = (x.strip() for x in line.partition(","))
        if pid:
            where.setdefault(pid, set()).add(uuid)
    return where


def placement_after_save(run: Run) -> str:
    """A run with async saves: once its first checkpoint is complete, every process must be on one GPU."""
    out = run.out / "placement"
    args = [*run_cli_prefix(8), *MODEL, "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "400", "--save-interval",
            "5", "--async-save", "--out", str(out)]
    proc = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + run.left(180)
        while not (out / "checkpoints" / "step_00000010").is_dir():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"no second checkpoint:\n{tail(proc.stderr.read() if proc.stderr else '')}")
            time.sleep(0.5)
        where = _placement()
    finally:
        stop(proc)
    multi = {pid: sorted(g) for pid, g in where.items() if len(g) > 1}
    expect(len(where) >= 8 and not multi, f"processes on several GPUs after an async save: {multi or where}")
    return f"{len(where)} processes, one GPU each, after two async saves"


def run_cli_prefix(nproc: int) -> list[str]:
    return [sys.executable, "-m", "megatronapp", "train", "--nproc", str(nproc)]


def throughput(run: Run, flags: list[str], steps: int = 20) -> float:
    out = run.out / f"tps-{len(run.facts.get('throughput', {}))}"
    run_cli(["train", "--nproc", "8", *MODEL, "--hidden", "512", "--heads", "8", "--seq-len", "256",
             "--global-batch", "32", "--microbatches", "8", *flags, "--steps", str(steps), "--out", str(out)],
            run.left(240))
    recs = metrics(out)
    return sum(r["tokens_per_s"] for s, r in recs.items() if s > 5) / max(1, len(recs) - 5)


def many_gpus(run: Run) -> str:
    import torch

    if run.kind == "cuda" and torch.cuda.device_count() < run.gpus:
        raise CheckSkipped(f"--gpus {run.gpus}: this machine has {torch.cuda.device_count()}")
    steps, done = 3, []
    ref_runs: dict[tuple[str, ...], dict[int, dict]] = {}
    for i, (name, (nproc, flags)) in enumerate(EIGHT_GPUS.items()):
        shape = tuple(x for i, f in enumerate(flags) if f in SHAPE_FLAGS for x in (f, flags[i + 1]))
        if shape not in ref_runs:  # one GPU, the same model and global batch
            ref = run.out / f"ref-{len(ref_runs)}"
            run_cli(["train", "--nproc", "1", *MODEL, *shape, "--steps", str(steps), "--out", str(ref)],
                    run.left(240))
            ref_runs[shape] = metrics(ref)
        out = run.out / f"layout-{i}"
        run_cli(["train", "--nproc", str(nproc), *MODEL, *flags, "--steps", str(steps), "--out", str(out)],
                run.left(300))
        done.append(f"{name}: {compare(name, metrics(out), ref_runs[shape]):.1e}")
    placed = placement_after_save(run) if run.kind == "cuda" else "placement: GPU only"
    sp = ["--tp", "2", "--pp", "2", "--dp", "2", "--sequence-parallel"]
    tps = {"overlap": throughput(run, [*sp, "--tp-comm-overlap"]),
           "no overlap": throughput(run, [*sp, "--no-pp-overlap", "--no-dp-overlap"])}
    run.facts["throughput"] = tps
    return (f"{len(done)} layouts match one GPU ({'; '.join(done)}); {placed}; tokens/s with overlap "
            f"{tps['overlap']:.0f}, without {tps['no overlap']:.0f}")


def check_ranks(run: Run) -> str:
    """One GPU: NCCL ranks sharing it; `--gpus N` > 1: the multi-GPU set."""
    return one_gpu(run) if run.gpus == 1 else many_gpus(run)


def plan() -> dict[str, Any]:
    """Every multi-rank configuration of this check, for the tests that validate them without running them."""
    return {"one_gpu": ONE_GPU, "eight_gpus": EIGHT_GPUS, "model": MODEL, "nccl_env": NCCL_ENV}


if __name__ == "__main__":
    print(json.dumps(plan(), indent=1))
