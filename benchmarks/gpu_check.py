"""GPU check: on a machine with one CUDA GPU, run the CUDA paths that CPU tests cannot reach (under 10 minutes).

1. train: single-rank training with `--dtype bf16` (backend auto picks NCCL when a GPU is present, and the trainer
   then runs on cuda:0). The loss must be finite and falling; a plug-in (`record_device`, attached with
   `--attach`) records the trainer's device, its parameters' devices and the autocast dtype.
2. scan: the same run is traced. Its trace header must say the CUDA-event clock, forward/backward spans must
   exist with positive durations, and `scan aggregate` / `scan detect --json` must read the trace.
3. scope: `scope serve --device cuda` serves the embedded model from the GPU; a greedy generation through the
   WebSocket protocol must return the requested captures, the same tokens as the same request on the CPU and
   probabilities within 1e-3 of the CPU's.

Prints one PASS/FAIL line per check and a summary; exit 0 when all pass, 1 when one fails. On a machine without a
CUDA GPU it prints "no CUDA GPU: skipped" and exits 0. Run `benchmarks/gpu_check.sh [--out DIR]`.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatronapp"]
DEVICE_FILE = "gpu_check_device.json"
TRAIN_STEPS = 30
REHEARSAL_STEPS = 12  # CPU bf16 on 2 loaded cores is slow; still one trace window (steps 7-9)
REQUEST = {"type": "generate", "prompts": ["After Monday comes ", "The"], "max_new_tokens": 8, "greedy": True,
           "capture": {"points": ["attn.q", "attn.probs", "mlp.out", "logits"], "layers": [0, 1],
                       "logit_lens": True, "pca_layer": 1}}


class CheckFailed(Exception):
    """A check's assertion, with what was seen."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def record_device(trainer: Any) -> None:
    """Plug-in (`--attach benchmarks.gpu_check:record_device`): write where rank 0 trains, for check 1."""
    if trainer.rank != 0:
        return
    autocast = getattr(trainer.autocast, "fast_dtype", None)  # a nullcontext (fp32) has none
    info = {"device": str(trainer.device),
            "param_devices": sorted({str(q.device) for c in trainer.chunks for q in c.parameters()}),
            "autocast": str(autocast) if autocast is not None else None}
    Path(trainer.out).mkdir(parents=True, exist_ok=True)
    (Path(trainer.out) / DEVICE_FILE).write_text(json.dumps(info))


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # the ranks import the plug-in above by its module path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_cli(args: list[str], timeout: float) -> str:
    """Run `megatronapp ARGS`; its stdout, or CheckFailed with the stderr tail."""
    proc = subprocess.Popen([*CLI, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise CheckFailed(f"`megatronapp {' '.join(args)}` ran past {timeout:.0f} s") from None
    if proc.returncode:
        raise CheckFailed(f"`megatronapp {' '.join(args)}` exited {proc.returncode}:\n{_tail(err)}")
    return out


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process this script started, with everything it spawned (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass


# -- 1. training ------------------------------------------------------------------------------------------------
def check_train(out: Path, kind: str) -> str:
    run = out / "train"
    steps = TRAIN_STEPS if kind == "cuda" else REHEARSAL_STEPS
    run_cli(["train", "--nproc", "1", "--dtype", "bf16", "--steps", str(steps), "--out", str(run),
             "--trace", "--trace-interval", "10", "--trace-iterations", "3", "--no-progress",
             "--attach", "benchmarks.gpu_check:record_device"], timeout=300 if kind == "cuda" else 900)
    dev = json.loads((run / DEVICE_FILE).read_text())
    expect(dev["device"].startswith(kind), f"the trainer ran on {dev['device']}, not on {kind}")
    expect(dev["param_devices"] == [dev["device"]], f"parameters on {dev['param_devices']}, trainer on {dev['device']}")
    expect(dev["autocast"] == "torch.bfloat16", f"--dtype bf16 ran with autocast dtype {dev['autocast']}")
    summary = json.loads((run / "summary.json").read_text())
    losses = summary["losses"]
    expect(len(losses) == steps, f"{len(losses)} losses for {steps} steps")
    expect(all(math.isfinite(x) for x in losses), f"non-finite losses: {losses}")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    expect(last < 0.9 * first, f"loss did not fall: mean of the first 5 steps {first:.3f}, of the last 5 {last:.3f}")
    return (f"{dev['device']}, autocast bf16, loss {first:.3f} -> {last:.3f} over {steps} steps, "
            f"{summary['mean_step_time_s'] * 1e3:.1f} ms/step, peak {summary['peak_mem_bytes'] / 2**20:.0f} MiB")


# -- 2. MegaScan's CUDA-event path ------------------------------------------------------------------------------
def check_scan(out: Path, kind: str) -> str:
    from megatronapp.scan.read.format import read_dir

    trace = out / "train" / "trace"
    expect(trace.is_dir(), f"{trace} missing (the training check must run first)")
    traces, problems = read_dir(trace)
    expect(len(traces) == 1 and not problems, f"{len(traces)} rank traces, problems: {problems}")
    t = traces[0]
    clock = "cuda_event" if kind == "cuda" else "monotonic_ns"
    expect(t.header.get("clock") == clock, f"trace clock is {t.header.get('clock')!r}, not {clock!r}")
    seen = []
    for name in ("forward", "backward", "optimizer"):
        dur = t.dur[t.name == t.name_id(name)]
        expect(len(dur) > 0, f"no {name!r} spans in the trace")
        expect(bool((dur > 0).all()), f"{int((dur <= 0).sum())} of {len(dur)} {name!r} spans have no duration")
        seen.append(f"{name} {len(dur)} x {float(dur.mean()) / 1e3:.0f} us")
    merged = out / "trace.json.gz"
    run_cli(["scan", "aggregate", str(trace), "-o", str(merged)], timeout=120)
    events = json.loads(gzip.decompress(merged.read_bytes()))["traceEvents"]
    forwards = [e for e in events if e.get("ph") == "X" and e.get("name") == "forward"]
    expect(bool(forwards) and all(e["dur"] > 0 for e in forwards), "merged timeline: no forward slices with duration")
    report = json.loads(run_cli(["scan", "detect", str(trace), "--json"], timeout=120))
    expect(isinstance(report, dict), "scan detect --json did not print a JSON object")
    return f"clock {clock}, {len(t)} spans ({', '.join(seen)}); aggregate and detect read it"


# -- 3. MegaScope serving on CUDA -------------------------------------------------------------------------------
def _serve(log: Path, kind: str) -> tuple[subprocess.Popen, str]:
    """Start `scope serve --device KIND`; the process and the URL it prints."""
    with open(log, "w") as f:
        proc = subprocess.Popen([*CLI, "scope", "serve", "--device", kind], cwd=ROOT, env=_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://\S+", log.read_text())
        if found:
            return proc, found.group(0)
        time.sleep(0.2)
    _stop(proc)
    raise CheckFailed(f"scope serve --device {kind} printed no URL:\n{_tail(log.read_text())}")


def _conversation(url: str) -> tuple[dict, list[dict]]:
    """hello, then the messages of one generation, over the WebSocket protocol."""
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


def check_scope(out: Path, kind: str) -> str:
    proc, url = _serve(out / "scope_serve.log", kind)
    try:
        hello, msgs = _conversation(url)
    finally:
        _stop(proc)
    expect(hello.get("type") == "hello", f"first message {hello.get('type')!r}, not hello")
    name = (hello.get("model") or {}).get("name", "")
    expect(("cuda" in name) == (kind == "cuda"), f"the served model says it runs as {name!r}, asked for {kind}")
    expect(msgs[-1]["type"] == "done", f"generation ended with {msgs[-1]}")
    done, steps = msgs[-1], [m for m in msgs if m["type"] == "step"]
    expect(done["new_tokens"] == REQUEST["max_new_tokens"] * len(REQUEST["prompts"]),
           f"{done['new_tokens']} new tokens")
    captured = {n for m in steps for n in m.get("states", {})}
    wanted = {f"layers.{L}.{p}" for L in (0, 1) for p in ("attn.q", "attn.probs", "mlp.out")} | {"logits"}
    expect(wanted <= captured, f"captures missing: {sorted(wanted - captured)}")
    expect(all(len(m.get("lens", [])) > 0 for m in steps), "logit-lens rows missing from some steps")
    expect(any(m["type"] == "pca" for m in msgs), "no pca message")
    ref = [m for m in _cpu_reference() if m["type"] in ("step", "done")]
    expect(ref[-1]["texts"] == done["texts"], f"GPU texts {done['texts']} != CPU texts {ref[-1]['texts']}")
    gaps = [abs(a["prob"] - b["prob"]) for g, c in zip(steps, ref)
            for a, b in zip(g.get("next", []), c.get("next", [])) if a["prob"] is not None and b["prob"] is not None]
    expect(bool(gaps) and max(gaps) < 1e-3, f"token probabilities differ from the CPU's by {max(gaps or [0]):.1e}")
    return (f"{name}: {len(steps)} steps, {len(captured)} capture points, {done['tokens_per_s']} tok/s; "
            f"same tokens as the CPU, probabilities within {max(gaps):.1e}")


CHECKS: list[tuple[str, Callable[[Path, str], str]]] = [
    ("train: single rank, bf16, CUDA", check_train),
    ("scan: CUDA-event spans, aggregate, detect", check_scan),
    ("scope: serve --device cuda over WebSocket", check_scope),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where runs, traces and logs go (default: a new temporary directory)")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="the same checks on the CPU (host clock, --device cpu): tests this script without a GPU")
    args = parser.parse_args(argv)
    import torch

    kind = "cpu" if args.rehearse_on_cpu else "cuda"
    if kind == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU: skipped (torch {torch.__version__}, torch.cuda.is_available() is False)")
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    where = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if kind == "cuda" else "CPU rehearsal"
    print(f"gpu_check: {where}, torch {torch.__version__}; files in {out}", flush=True)
    passed = 0
    t_all = time.perf_counter()
    for name, check in CHECKS:
        t0 = time.perf_counter()
        try:
            detail, ok = check(out, kind), True
        except CheckFailed as e:
            detail, ok = str(e), False
        except Exception as e:  # noqa: BLE001 - report and go on with the other checks
            detail, ok = f"{type(e).__name__}: {e}", False
        passed += ok
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.0f} s): {detail}", flush=True)
    print(f"gpu_check: {passed}/{len(CHECKS)} passed in {time.perf_counter() - t_all:.0f} s")
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
