"""`megatronapp demo` (what `make demo` runs): train the embedded default on 4 CPU ranks, sample from it, then a
MegaScan drill in which one rank is made slow and the detector has to name it."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from megatronapp.config import ParallelConfig, RunConfig, TraceConfig, TrainConfig, preset
from megatronapp.parallel.topology import Topology


def _banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 74 - len(text)), flush=True)


def sample(checkpoint: Path, prompt: str, new_tokens: int = 80) -> str:
    """Greedy continuation of `prompt` by the (consolidated) checkpoint, with the byte tokenizer."""
    from megatronapp.data.tokenizer import ByteTokenizer
    from megatronapp.model.transformer import KVCache
    from megatronapp.train.consolidate import load_model

    model = load_model(checkpoint).eval()
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode(prompt)])
    cache = KVCache(model, batch=1, max_len=ids.shape[1] + new_tokens)
    out: list[int] = []
    with torch.no_grad():
        logits = model(ids, kv_cache=cache, start_pos=0)
        pos = ids.shape[1]
        for _ in range(new_tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            logits = model(torch.tensor([[nxt]]), kv_cache=cache, start_pos=pos)
            pos += 1
    return tok.decode(out)


def demo_recipe(steps: int, out: str) -> TrainConfig:
    """The demo's recipe: the default learning rate, warm-up and clipping, 16 sequences of 64 bytes per step."""
    return TrainConfig(steps=steps, global_batch_size=16, seq_len=64, out=out, save_interval=0)


def loss_curve(metrics: Path, png: Path) -> Path:
    """Plot the per-step loss of a run's metrics.jsonl (and its 10-step median) into `png`."""
    from megatronapp.train.plot import loss_curve as plot

    return plot(metrics, png, "make demo: gpt2-tiny, tp2 x pp2, embedded corpus")


def train_part(out: Path, steps: int) -> Path:
    from megatronapp.train.trainer import train

    cfg = RunConfig(model=preset("gpt2-tiny"),
                    parallel=ParallelConfig(tp=2, pp=2, dp=1, microbatches=4, schedule="1f1b"),
                    train=demo_recipe(steps, str(out / "train")))
    _banner("1/2  3D-parallel training of the embedded default model")
    print(f"model: gpt2-tiny, {cfg.model.num_params() / 1e6:.2f} M parameters, byte-level tokens, embedded corpus")
    print(Topology(tp=2, pp=2, dp=1).describe())
    summary = train(cfg)
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in {summary['steps']} steps, "
          f"{summary['tokens_per_s']:.0f} tokens/s on {summary['world_size']} ranks")
    print(f"loss curve: {loss_curve(out / 'train' / 'metrics.jsonl', out / 'train' / 'loss.png')}")
    ckpt = Path(summary["checkpoint"])
    for prompt in ("Today is Monday, so tomorrow is", "Tom has 3 pears. Sam gives Tom 4 more."):
        print(f"sample (greedy): {prompt!r} -> {sample(ckpt, prompt, 40)!r}")
    return ckpt


def scan_part(out: Path, steps: int) -> int:
    from megatronapp.scan import heatmap
    from megatronapp.scan.aggregate import aggregate
    from megatronapp.scan.detect.align import estimate_offsets
    from megatronapp.scan.detect.analysis import analyse
    from megatronapp.scan.read.format import read_dir
    from megatronapp.train.trainer import train

    slow_rank, factor = 3, 2.0
    trace_dir = out / "scan" / "trace"
    cfg = RunConfig(model=preset("gpt2-tiny"),
                    parallel=ParallelConfig(tp=1, pp=2, dp=2, microbatches=4, schedule="1f1b"),
                    train=TrainConfig(steps=steps, global_batch_size=16, seq_len=64, out=str(out / "scan"),
                                      progress=False),
                    trace=TraceConfig(enabled=True, dir=str(trace_dir), interval=steps, iterations=steps - 1),
                    inject=[f"slow-compute={slow_rank}:{factor}"])
    _banner("2/2  MegaScan drill: one rank computes slower; who is it?")
    topo = Topology(tp=1, pp=2, dp=2)
    print(f"injecting slow-compute={slow_rank}:{factor} (rank {slow_rank} = "
          f"{topo.describe().splitlines()[slow_rank + 1].split()[2]}) into a traced run of {steps} steps")
    train(cfg)
    traces, problems = read_dir(trace_dir)
    for p in problems:
        print(f"  trace problem: {p}")
    offsets, residual, _ = estimate_offsets(traces)
    trace_json = out / "scan" / "trace.json.gz"
    aggregate(trace_dir, trace_json, offsets)
    analysis = analyse(traces, offsets)
    print(analysis.report.to_text())
    png = heatmap.write(analysis, out / "scan" / "heatmap.png")
    html = heatmap.write(analysis, out / "scan" / "heatmap.html")
    top = analysis.report.findings[0] if analysis.report.findings else None
    named = top is not None and top.kind == "slow-compute" and tuple(top.ranks) == (slow_rank,)
    print(f"\nclock alignment residual: {residual / 1e3:.1f} us")
    verdict = f"MegaScan named the injected rank {slow_rank}" if named else "MEGASCAN MISSED the injected rank"
    print(f"verdict: {verdict}")
    print(f"timeline (open in https://ui.perfetto.dev or chrome://tracing): {trace_json}")
    print(f"heat-map: {png}  (interactive: {html})")
    return 0 if named else 1


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    steps = 12 if args.quick else args.steps
    t0 = time.perf_counter()
    ckpt = train_part(out, steps)
    code = scan_part(out, 8 if args.quick else 10)
    _banner("done")
    print(f"in {time.perf_counter() - t0:.0f} s. Run files: {out}/train (metrics.jsonl, summary.json, "
          f"checkpoints/), {out}/scan")
    print(f"next: megatronapp scope serve --checkpoint {ckpt}   (watch the model think in your browser)")
    return code
