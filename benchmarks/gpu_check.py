"""GPU check: run the CUDA paths that CPU tests cannot reach, on the machine as it is (docs/install-gpu.md).

One GPU (default), within 8 minutes:
  env      the machine: nvidia-smi's GPUs, torch and its CUDA, NCCL, the packages. A GPU that nvidia-smi lists but
           torch cannot use FAILS the whole check at once (exit 2): never a silent skip on a GPU machine.
  train    bf16 Llama (RoPE) with full recompute, async saves, evaluation and MegaScan tracing on cuda:0; the
           trainer's device, its parameters' devices and the autocast dtype are recorded by a plug-in; the loss
           must fall and the held-out loss be finite.
  resume   the same run resumed from its step-SAVE_AT checkpoint: its losses must equal the uninterrupted run's.
  sync     host-device synchronisations per step (`torch.cuda.set_sync_debug_mode`, counted by a plug-in) in
           the steps without evaluation, save or trace window: at most SYNC_BUDGET.
  scan     the trace uses the CUDA-event clock, spans have durations, `scan aggregate` / `scan detect` read it.
  scope    `scope serve --device cuda`: one generation over WebSocket, the same tokens as on the CPU.
  ranks    several NCCL ranks on the one GPU (benchmarks/gpu_check_ranks.py): tp2 x pp2 (SP, TP overlap, DPP)
           and dp2 x pp2 vpp2 ZeRO-1, losses against the same configs on gloo/CPU.
`--gpus 8`: the multi-GPU set of gpu_check_ranks.py instead of `ranks`.

`--rehearse-on-cpu` runs the same script on the CPU (gloo stands in for NCCL, the host clock for CUDA events), so
the first GPU run tests the hardware, not the script; `--quick` keeps the rehearsal short for `make test`.
One line per check: PASS, FAIL or SKIP with the reason; the results go to JSON (`--json`, default
$OUT/gpu_check.json, else OUT_DIR/gpu_check.json). Exit 0 when nothing failed, 1 when a check failed, 2 when
a GPU is present that torch cannot use.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
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
    stop,
    tail,
)
from benchmarks.gpu_check_ranks import check_ranks

DEVICE_FILE = "gpu_check_device.json"
SYNC_FILE = "gpu_check_syncs.json"
TIME_LIMIT_S = 480.0  # one GPU: the whole check
# Host-device synchronisations allowed per training step of one stage (tests/test_sync_budget.py holds the
# engine's part on the CPU): the global gradient norm and the global loss, read once each; one spare for what
# only a GPU shows (a caching-allocator or cuBLAS call). A pipeline stage with a static schedule adds its header
# check (pipeline/p2p.py).
SYNC_BUDGET = 3
MODEL_GPU = ["--model", "llama-tiny", "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--layers", "4",
             "--seq-len", "128", "--global-batch", "8", "--microbatches", "2"]
MODEL_CPU = ["--model", "llama-tiny", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--layers", "2",
             "--seq-len", "16", "--global-batch", "2", "--microbatches", "2"]
REQUEST = {"type": "generate", "prompts": ["After Monday comes ", "The"], "max_new_tokens": 8, "greedy": True,
           "capture": {"points": ["attn.q", "attn.probs", "mlp.out", "logits"], "layers": [0, 1],
                       "logit_lens": True, "pca_layer": 1}}
SERVER_PACKAGES = ("fastapi", "uvicorn", "pydantic", "websockets")


# -- plug-ins (attached to the training run with --attach) --------------------------------------------------------
def record_device(trainer: Any) -> None:
    """Plug-in: write where rank 0 trains, for the train check."""
    if trainer.rank != 0:
        return
    autocast = getattr(trainer.autocast, "fast_dtype", None)  # a nullcontext (fp32) has none
    info = {"device": str(trainer.device),
            "param_devices": sorted({str(q.device) for c in trainer.chunks for q in c.parameters()}),
            "autocast": str(autocast) if autocast is not None else None}
    Path(trainer.out).mkdir(parents=True, exist_ok=True)
    (Path(trainer.out) / DEVICE_FILE).write_text(json.dumps(info))


def count_syncs(trainer: Any) -> None:
    """Plug-in: count each step's host-device synchronisations on rank 0 (`torch.cuda.set_sync_debug_mode` warns
    at every synchronising CUDA call) and write them per step, with the Python lines that caused them."""
    import torch

    if trainer.rank != 0 or trainer.device.type != "cuda":
        return
    per_step: dict[int, dict[str, Any]] = {}
    state: dict[str, Any] = {}

    def start(step: int) -> None:
        state["ctx"] = warnings.catch_warnings(record=True)
        state["log"] = state["ctx"].__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def end(step: int, record: dict) -> None:
        torch.cuda.set_sync_debug_mode("default")
        log = state.pop("log")
        state.pop("ctx").__exit__(None, None, None)
        syncs = [w for w in log if "synchroniz" in str(w.message)]
        per_step[step] = {"syncs": len(syncs), "where": sorted({f"{Path(w.filename).name}:{w.lineno}"
                                                                for w in syncs}),
                          "eval": "val_loss" in record}
        (Path(trainer.out) / SYNC_FILE).write_text(json.dumps(per_step))

    trainer.hooks.on("step_start", start)
    trainer.hooks.on("step_end", end)


# -- env -------------------------------------------------------------------------------------------------------
def nvidia_smi_gpus() -> list[str]:
    """The GPUs nvidia-smi lists ([] without nvidia-smi, or when it lists none)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def check_env(run: Run) -> str:
    import torch

    gpus = nvidia_smi_gpus()
    cuda = torch.cuda.is_available()
    run.facts.update(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
                     nvidia_smi=gpus, cuda_available=cuda, executable=sys.executable)
    missing = [p for p in SERVER_PACKAGES if _missing(p)]
    run.facts["missing_packages"] = missing
    if cuda:
        run.facts.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                         nccl=".".join(map(str, torch.cuda.nccl.version())))
    where = run.facts.get("device", "no GPU")
    return (f"python {run.facts['python']}, torch {torch.__version__} (CUDA {torch.version.cuda}), {where}; "
            f"nvidia-smi lists {len(gpus)} GPU(s)" + (f"; missing {', '.join(missing)}" if missing else ""))


def _missing(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is None


# -- train, resume, sync ---------------------------------------------------------------------------------------
def _train_args(run: Run, out: Path) -> list[str]:
    model = MODEL_GPU if run.kind == "cuda" else MODEL_CPU
    return ["train", "--nproc", "1", *model, "--dtype", "bf16", "--recompute", "full", "--steps", str(run.steps),
            "--save-interval", str(run.save_at), "--async-save", "--eval-interval", str(run.save_at),
            "--eval-iters", "2", *(["--lr", "3e-3", "--warmup", "2"] if run.kind == "cuda" else  # 4 steps on the CPU
                                  ["--lr", "2e-2", "--warmup", "1"]), "--data-prefetch", "2", "--out", str(out),
            "--no-progress"]


def check_train(run: Run) -> str:
    out = run.out / "train"
    run_cli([*_train_args(run, out), "--trace", "--trace-interval", str(run.save_at), "--trace-iterations", "2",
             "--attach", "benchmarks.gpu_check:record_device", "--attach", "benchmarks.gpu_check:count_syncs"],
            timeout=run.left(240 if run.kind == "cuda" else 300))
    dev = json.loads((out / DEVICE_FILE).read_text())
    expect(dev["device"].startswith(run.kind), f"the trainer ran on {dev['device']}, not on {run.kind}")
    expect(dev["param_devices"] == [dev["device"]], f"parameters on {dev['param_devices']}, trainer on {dev['device']}")
    expect(dev["autocast"] == "torch.bfloat16", f"--dtype bf16 ran with autocast dtype {dev['autocast']}")
    recs = metrics(out)
    losses = [recs[s]["loss"] for s in sorted(recs)]
    expect(len(losses) == run.steps, f"{len(losses)} losses for {run.steps} steps")
    expect(all(math.isfinite(x) for x in losses), f"non-finite losses: {losses}")
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    expect(last < 0.95 * first, f"loss did not fall: {first:.3f} over the first 2 steps, {last:.3f} over the last 2")
    vals = [r["val_loss"] for r in recs.values() if "val_loss" in r]
    expect(bool(vals) and all(math.isfinite(v) for v in vals), f"held-out losses {vals}")
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    expect(f"step_{run.save_at:08d}" in saved, f"no async checkpoint at step {run.save_at}: {saved}")
    summary = json.loads((out / "summary.json").read_text())
    run.facts["train"] = {"losses": losses, "val_losses": vals, "ms_per_step": summary["mean_step_time_s"] * 1e3,
                          "peak_mem_bytes": summary["peak_mem_bytes"], "save_stall_s": summary.get("save_stall_s")}
    return (f"{dev['device']}, bf16, loss {first:.3f} -> {last:.3f} over {run.steps} steps, held-out {vals[-1]:.3f}, "
            f"{summary['mean_step_time_s'] * 1e3:.1f} ms/step, checkpoints {len(saved)}")


def check_resume(run: Run) -> str:
    whole = run.out / "train"
    expect((whole / "metrics.jsonl").is_file(), "the train check did not run")
    out = run.out / "resume"
    step_dir = whole / "checkpoints" / f"step_{run.save_at:08d}"
    run_cli([*_train_args(run, out), "--resume", str(step_dir)], timeout=run.left(200 if run.kind == "cuda" else 300))
    a, b = metrics(whole), metrics(out)
    steps = sorted(s for s in b if s > run.save_at)
    expect(steps == list(range(run.save_at + 1, run.steps + 1)), f"the resumed run logged steps {steps}")
    gaps = [abs(a[s]["loss"] - b[s]["loss"]) for s in steps]
    # The CPU is deterministic: equal to the last bit. A GPU's kernels may use atomics (a resume bug shows as
    # differences of 1e-2 and more from its first step on): 2e-3 on a bf16 loss of ~5.
    tol = 0.0 if run.kind == "cpu" else 2e-3
    run.facts["resume"] = {"max_loss_gap": max(gaps), "tolerance": tol}
    expect(max(gaps) <= tol, f"resumed losses differ from the uninterrupted run's by up to {max(gaps):.2e} "
                             f"(allowed {tol:g}): step {steps[gaps.index(max(gaps))]}")
    return f"steps {steps[0]}-{steps[-1]} from the step-{run.save_at} checkpoint, largest loss gap {max(gaps):.1e}"


def check_sync(run: Run) -> str:
    if run.kind != "cuda":
        raise CheckSkipped("the CPU has no device to synchronise with; tests/test_sync_budget.py holds the engine's "
                           "host reads per step on the CPU")
    path = run.out / "train" / SYNC_FILE
    expect(path.is_file(), "the train check wrote no sync counts (count_syncs plug-in)")
    per_step = {int(k): v for k, v in json.loads(path.read_text()).items()}
    # Outside the budget: a trace window's first step (its anchor), the step that evaluates, and the two after a
    # save (the snapshot barrier and the writer thread each wait for the copy stream); the first steps warm up.
    busy = {s for s in per_step if s % run.save_at in (run.save_at - 1, 0, 1, 2)}
    plain = {s: v for s, v in per_step.items() if s > 2 and s not in busy and not v["eval"]}
    expect(bool(plain), f"no plain step among {sorted(per_step)}")
    worst = max(plain, key=lambda s: plain[s]["syncs"])
    run.facts["sync"] = {"budget": SYNC_BUDGET, "per_step": per_step}
    expect(plain[worst]["syncs"] <= SYNC_BUDGET, f"step {worst}: {plain[worst]['syncs']} synchronisations "
                                                 f"(budget {SYNC_BUDGET}) at {plain[worst]['where']}")
    return (f"at most {plain[worst]['syncs']} per step over {len(plain)} plain steps (budget {SYNC_BUDGET}): "
            f"{', '.join(plain[worst]['where'])}")


# -- MegaScan's CUDA-event path --------------------------------------------------------------------------------
def check_scan(run: Run) -> str:
    from megatronapp.scan.read.format import read_dir

    trace = run.out / "train" / "trace"
    expect(trace.is_dir(), f"{trace} missing (the train check must run first)")
    traces, problems = read_dir(trace)
    expect(len(traces) == 1 and not problems, f"{len(traces)} rank traces, problems: {problems}")
    t = traces[0]
    clock = "cuda_event" if run.kind == "cuda" else "monotonic_ns"
    expect(t.header.get("clock") == clock, f"trace clock is {t.header.get('clock')!r}, not {clock!r}")
    seen = []
    for name in ("forward", "backward", "optimizer"):
        dur = t.dur[t.name == t.name_id(name)]
        expect(len(dur) > 0, f"no {name!r} spans in the trace")
        expect(bool((dur > 0).all()), f"{int((dur <= 0).sum())} of {len(dur)} {name!r} spans have no duration")
        seen.append(f"{name} {len(dur)} x {float(dur.mean()) / 1e3:.0f} us")
    merged = run.out / "trace.json.gz"
    run_cli(["scan", "aggregate", str(trace), "-o", str(merged)], timeout=run.left(120))
    events = json.loads(gzip.decompress(merged.read_bytes()))["traceEvents"]
    forwards = [e for e in events if e.get("ph") == "X" and e.get("name") == "forward"]
    expect(bool(forwards) and all(e["dur"] > 0 for e in forwards), "merged timeline: no forward slices with duration")
    report = json.loads(run_cli(["scan", "detect", str(trace), "--json"], timeout=run.left(120)))
    expect(isinstance(report, dict), "scan detect --json did not print a JSON object")
    return f"clock {clock}, {len(t)} spans ({', '.join(seen)}); aggregate and detect read it"


# -- MegaScope serving on CUDA ---------------------------------------------------------------------------------
def _serve(log: Path, kind: str) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as f:
        proc = subprocess.Popen([*CLI, "scope", "serve", "--device", kind], cwd=ROOT, env=env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://\S+", log.read_text())
        if found:
            return proc, found.group(0)
        time.sleep(0.2)
    stop(proc)
    raise CheckFailed(f"scope serve --device {kind} printed no URL:\n{tail(log.read_text())}")


def _conversation(url: str) -> tuple[dict, list[dict]]:
    from urllib.parse import urlsplit

    from websockets.sync.client import connect

    u = urlsplit(url)
    ws_url = f"ws://{u.netloc}/ws" + (f"?{u.query}" if u.query else "")
    with connect(ws_url, open_timeout=30, max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=60))
        ws.send(json.dumps(REQUEST))
        msgs: list[dict] = []
        while not msgs or msgs[-1]["type"] not in ("done", "error"):
            msgs.append(json.loads(ws.recv(timeout=120)))
    return hello, msgs


def _cpu_reference() -> list[dict]:
    from megatronapp.data.tokenizer import ByteTokenizer
    from megatronapp.scope.default_model import load_default_model
    from megatronapp.scope.generate import ScopeModel, generate
    from megatronapp.scope.protocol import Generate

    model, cfg, meta = load_default_model()
    msgs: list[dict] = []
    generate(ScopeModel(model, cfg, ByteTokenizer(), meta=meta), Generate.model_validate(REQUEST), msgs.append)
    return msgs


def check_scope(run: Run) -> str:
    missing = [p for p in SERVER_PACKAGES if _missing(p)]
    if missing:
        raise CheckSkipped(f"{', '.join(missing)} not importable: carry their wheels in .whl/ (docs/install-gpu.md)")
    proc, url = _serve(run.out / "scope_serve.log", run.kind)
    try:
        hello, msgs = _conversation(url)
    finally:
        stop(proc)
    expect(hello.get("type") == "hello", f"first message {hello.get('type')!r}, not hello")
    name = (hello.get("model") or {}).get("name", "")
    expect(("cuda" in name) == (run.kind == "cuda"), f"the served model says it runs as {name!r}, not {run.kind}")
    expect(msgs[-1]["type"] == "done", f"generation ended with {msgs[-1]}")
    done, steps = msgs[-1], [m for m in msgs if m["type"] == "step"]
    expect(done["new_tokens"] == REQUEST["max_new_tokens"] * len(REQUEST["prompts"]), f"{done['new_tokens']} tokens")
    captured = {n for m in steps for n in m.get("states", {})}
    wanted = {f"layers.{L}.{p}" for L in (0, 1) for p in ("attn.q", "attn.probs", "mlp.out")} | {"logits"}
    expect(wanted <= captured, f"captures missing: {sorted(wanted - captured)}")
    ref = [m for m in _cpu_reference() if m["type"] in ("step", "done")]
    expect(ref[-1]["texts"] == done["texts"], f"GPU texts {done['texts']} != CPU texts {ref[-1]['texts']}")
    gaps = [abs(a["prob"] - b["prob"]) for g, c in zip(steps, ref)
            for a, b in zip(g.get("next", []), c.get("next", [])) if a["prob"] is not None and b["prob"] is not None]
    expect(bool(gaps) and max(gaps) < 1e-3, f"token probabilities differ from the CPU's by {max(gaps or [0]):.1e}")
    return (f"{name}: {len(steps)} steps, {len(captured)} capture points; the CPU's tokens, probabilities within "
            f"{max(gaps):.1e}")


# -- the driver ------------------------------------------------------------------------------------------------
CHECKS: list[tuple[str, Callable[[Run], str]]] = [
    ("env", check_env), ("train", check_train), ("resume", check_resume), ("sync", check_sync),
    ("scan", check_scan), ("scope", check_scope), ("ranks", check_ranks),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where runs, traces and logs go (default: a new temporary directory)")
    parser.add_argument("--json", help="the results file (default: $OUT/gpu_check.json, else OUT_DIR/gpu_check.json)")
    parser.add_argument("--gpus", type=int, default=1, help="1 (default), or 8: the multi-GPU set of checks")
    parser.add_argument("--only", help="comma-separated checks to run (default: all): " +
                        ", ".join(n for n, _ in CHECKS))
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="the same checks on the CPU (gloo for NCCL, the host clock for CUDA events)")
    parser.add_argument("--quick", action="store_true", help="with --rehearse-on-cpu: the short rehearsal of make test")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as e:  # the machine's python has no torch: nothing can run, and that is a failure
        print(f"FAIL env (0 s): {sys.executable} cannot import torch ({e}); run with PYTHON=<a python with torch>")
        return 2 if nvidia_smi_gpus() else 1

    kind = "cpu" if args.rehearse_on_cpu else "cuda"
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else Path(os.environ.get("OUT") or out) / "gpu_check.json"
    run = Run(out, kind, quick=args.quick, gpus=args.gpus,
              deadline=time.monotonic() + (TIME_LIMIT_S if kind == "cuda" and args.gpus == 1 else 3600))
    only = set(args.only.split(",")) if args.only else {n for n, _ in CHECKS}
    results: list[dict[str, Any]] = []

    def report(name: str, status: str, detail: str, seconds: float) -> None:
        print(f"{status} {name} ({seconds:.0f} s): {detail}", flush=True)
        results.append({"check": name, "status": status, "detail": detail, "seconds": round(seconds, 1)})
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"kind": kind, "gpus": args.gpus, "results": results, "facts": run.facts},
                                        indent=1, default=str))

    gpus = nvidia_smi_gpus()
    if kind == "cuda" and gpus and not torch.cuda.is_available():
        # the one failure that must never read as a skip: this machine has GPUs that this torch cannot use
        check_env(run)
        report("env", "FAIL", f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}) but torch {torch.__version__} at "
               f"{sys.executable} has no CUDA (torch.version.cuda={torch.version.cuda}): install a CUDA build of "
               f"torch, or run with PYTHON=<a python whose torch has CUDA>", 0.0)
        print("gpu_check: FAILED: a GPU is present and torch cannot use it")
        return 2
    print(f"gpu_check: {'CPU rehearsal' if kind == 'cpu' else 'GPU'}, torch {torch.__version__}, "
          f"python {sys.executable}; files in {out}; results in {json_path}", flush=True)
    t_all = time.perf_counter()
    for name, check in CHECKS:
        t0 = time.perf_counter()
        if name not in only:
            continue
        if kind == "cuda" and not torch.cuda.is_available() and name != "env":
            report(name, "SKIP", "no GPU on this machine (nvidia-smi lists none, torch has no CUDA)", 0.0)
            continue
        try:
            status, detail = "PASS", check(run)
        except CheckSkipped as e:
            status, detail = "SKIP", str(e)
        except CheckFailed as e:
            status, detail = "FAIL", str(e)
        except Exception as e:  # noqa: BLE001 - report and go on with the other checks
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
        report(name, status, detail, time.perf_counter() - t0)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
          f"{time.perf_counter() - t_all:.0f} s")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
