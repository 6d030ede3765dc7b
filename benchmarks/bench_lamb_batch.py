"""LAMB at 4x the batch: does it reach AdamW's loss for the same number of tokens? (MegaScale section 3.1)

MegaScale reports that LAMB lets the batch grow 4x with no loss in accuracy, which cuts pipeline bubbles
(fewer, larger steps). Here the embedded default model (gpt2-tiny, byte tokens, embedded corpus) is trained in one
process by the engine's Trainer: AdamW at global batch B and LAMB at 4B, both for the same tokens (40% of a pass
over the corpus), so LAMB takes a quarter of the steps. Both see the same samples in the same order (the batch source
numbers samples globally). Warm-up covers the same tokens (so 1/4 the steps for LAMB), cosine decay to lr/10.

Learning rates, all reported. AdamW's are centred on the engine's default recipe (2e-3), x2 apart; 8e-3 was added
after 4e-3 came out best of the first three. LAMB's lr is another unit (each matrix moves by lr x ||w|| per step,
whatever the gradient scale), so its grid, fixed before any run, spans two anchors: the LAMB paper's BERT range
(about 1e-2), and the lr at which LAMB's first steps move each weight as far as AdamW's at 2e-3 do
(2e-3 / init std 0.02 = 1e-1). Control: AdamW at 4B too (the recipe's lr scaled by sqrt(4) and by 4), to tell what
LAMB adds at the large batch from what the large batch alone costs. Eval loss: held-out text from the same
grammar with another seed (never trained on), at 8 token checkpoints.

Run: python -m benchmarks.bench_lamb_batch          (writes results/lamb_batch.json, docs/img/lamb_batch.png, docs)
     python -m benchmarks.bench_lamb_batch --quick  (a few steps per run; writes nothing)
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from megatronapp.config import RunConfig, TrainConfig, preset
from megatronapp.data import corpus
from megatronapp.data.tokenizer import ByteTokenizer

RESULTS = harness.results_path("lamb_batch")
PNG = harness.ROOT / "docs" / "img" / "lamb_batch.png"
SECTION = "## LAMB at 4x the batch"
BATCH, SEQ = 8, 64
TOKENS = 163_840  # 40% of a pass over the ~400 KB embedded corpus: AdamW 320 steps at B=8, LAMB 80 at 4B=32
WARMUP_FRACTION = 0.05
EVALS = 8
# series -> (optimizer, batch, peak lrs, in the order they run: an interrupted experiment has the centres)
SERIES = {
    "adamw": ("adamw", BATCH, [2e-3, 1e-3, 4e-3, 8e-3]),  # around the default recipe, x2 apart
    "lamb": ("lamb", 4 * BATCH, [3e-2, 1e-2, 1e-1]),  # from the LAMB paper's 1e-2 to 2e-3 / init std 0.02
    "adamw_4b": ("adamw", 4 * BATCH, [4e-3, 8e-3]),  # control: the recipe's lr scaled by sqrt(4) and by 4
}
HELD_OUT_SEED = corpus.SEED + 1


def held_out(windows: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """`windows` rows of SEQ+1 bytes from text of the corpus grammar with an unseen seed."""
    tokens = ByteTokenizer().encode_tensor(corpus.generate(HELD_OUT_SEED, target_chars=windows * (SEQ + 1) + 1000))
    rows = tokens[: windows * (SEQ + 1)].long().view(windows, SEQ + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def eval_loss(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(model(data[0], labels=data[1]))
    model.train()
    return loss


def train_run(optimizer: str, lr: float, batch: int, tokens: int, data: tuple[torch.Tensor, torch.Tensor],
              out: str) -> dict[str, Any]:
    """One run of the engine's Trainer (single process); losses per step and eval losses by tokens seen."""
    from megatronapp.train.trainer import Trainer

    steps = tokens // (batch * SEQ)
    tcfg = TrainConfig(steps=steps, global_batch_size=batch, seq_len=SEQ, lr=lr, min_lr=lr / 10,
                       warmup_steps=max(1, round(WARMUP_FRACTION * steps)), optimizer=optimizer, out=out,
                       progress=False)
    tr = Trainer(RunConfig(model=preset("gpt2-tiny"), train=tcfg), rank=0)
    (model,) = tr.chunks
    every = max(1, steps // EVALS)
    train_loss, evals = [], [{"tokens": 0, "loss": eval_loss(model, data)}]
    t0 = time.perf_counter()
    try:
        while tr.step < steps:
            rec = tr.train_step()
            train_loss.append(rec["loss"])
            if tr.step % every == 0 or tr.step == steps:
                evals.append({"tokens": tr.step * batch * SEQ, "loss": eval_loss(model, data)})
    finally:
        close = getattr(tr, "close", None)
        if close is not None:
            close()
    return {"optimizer": optimizer, "lr": lr, "batch": batch, "steps": steps, "warmup_steps": tcfg.warmup_steps,
            "tokens_per_step": batch * SEQ, "train_loss": train_loss, "eval": evals,
            "final_eval": evals[-1]["loss"], "final_train_10": sum(train_loss[-10:]) / min(10, len(train_loss)),
            "seconds": time.perf_counter() - t0}


def _job(args: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    return train_run(*args)


def series_of(r: dict[str, Any]) -> str:
    return r["optimizer"] + ("" if r["batch"] == BATCH else "_4b" if r["optimizer"] == "adamw" else "")


def run(quick: bool = False, workers: int = 2, runs_log: str | None = None) -> dict[str, Any]:
    """Every run of SERIES, `workers` at a time; runs already in `runs_log` are kept, not repeated."""
    import concurrent.futures
    import multiprocessing

    data = held_out(16 if quick else 96)
    tokens = BATCH * 4 * SEQ * 8 if quick else TOKENS
    runs = []
    if runs_log and Path(runs_log).exists():
        runs = [json.loads(line) for line in Path(runs_log).read_text().splitlines() if line.strip()]
        runs = [r for r in runs if r["steps"] * r["tokens_per_step"] == tokens]
    done = {(r["optimizer"], r["batch"], r["lr"]) for r in runs}
    with tempfile.TemporaryDirectory() as d:
        jobs = [(opt, lr, batch, tokens, data, os.path.join(d, f"{opt}{batch}_{lr}"))
                for i in range(max(len(v[2]) for v in SERIES.values()))
                for opt, batch, lrs in SERIES.values() if i < len(lrs)
                for lr in [lrs[i]] if (opt, batch, lr) not in done]
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for r in pool.map(_job, jobs):
                runs.append(r)
                print(f"{r['optimizer']:5s} lr={r['lr']:.1e} batch={r['batch']:3d} steps={r['steps']:4d}: final "
                      f"eval {r['final_eval']:.3f}, train (last 10 steps) {r['final_train_10']:.3f}, "
                      f"{r['seconds']:.0f} s", flush=True)
                if runs_log:
                    with open(runs_log, "a") as f:
                        f.write(json.dumps(r) + "\n")
    return summarise(runs, tokens, data[0].numel())


def summarise(runs: list[dict[str, Any]], tokens: int, eval_tokens: int) -> dict[str, Any]:
    """The result record of a set of runs (each series' best by held-out loss)."""
    best = {}
    for key in SERIES:
        mine = [r for r in runs if series_of(r) == key]
        if mine:
            b = min(mine, key=lambda r: r["final_eval"])
            best[key] = {"lr": b["lr"], "batch": b["batch"], "final_eval": b["final_eval"]}
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": "gpt2-tiny", "seq_len": SEQ,
            "tokens": tokens, "batch": {"adamw": BATCH, "lamb": 4 * BATCH},
            "series": {k: {"optimizer": o, "batch": b, "lrs": lrs} for k, (o, b, lrs) in SERIES.items()},
            "warmup_fraction": WARMUP_FRACTION, "held_out_seed": HELD_OUT_SEED, "eval_tokens": eval_tokens,
            "runs": runs, "best": best,
            "lamb_minus_adamw_eval": best["lamb"]["final_eval"] - best["adamw"]["final_eval"],
            "machine": harness.machine()}


def plot(result: dict[str, Any], png: Path = PNG) -> Path:
    """Train loss (20-step mean, against tokens) and eval loss of every run; best of each optimizer bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=120, sharey=True)
    colours = {"adamw": "tab:blue", "lamb": "tab:red", "adamw_4b": "tab:green"}
    for r in sorted(result["runs"], key=lambda r: (series_of(r), r["lr"])):
        key = series_of(r)
        best = result["best"][key]["lr"] == r["lr"]
        style = dict(color=colours[key], lw=1.8 if best else 0.7, alpha=1.0 if best else 0.4,
                     ls="--" if key == "adamw_4b" else "-")
        label = f"{'LAMB' if r['optimizer'] == 'lamb' else 'AdamW'} B={r['batch']} lr={r['lr']:g}"
        w = max(1, 20 * BATCH // r["batch"])  # the same tokens per smoothing window for both batch sizes
        losses = r["train_loss"]
        smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot([(i + 1) * r["tokens_per_step"] for i in range(len(losses))], smooth, label=label, **style)
        bx.plot([e["tokens"] for e in r["eval"]], [e["loss"] for e in r["eval"]], marker="o", ms=3, label=label,
                **style)
    ax.set_title("train loss (mean over 10k tokens)")
    bx.set_title("held-out loss")
    for a in (ax, bx):
        a.set_xlabel("tokens")
        a.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
        a.set_ylim(top=3.5)
        a.grid(alpha=0.3)
    ax.set_ylabel("cross-entropy (nats/byte)")
    bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"gpt2-tiny, embedded corpus, same tokens: AdamW at batch {BATCH}, LAMB at {4 * BATCH} "
                 f"(AdamW at {4 * BATCH} dashed); best lr of each bold",
                 fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, bbox_inches="tight")
    plt.close(fig)
    return png


def table(result: dict[str, Any]) -> str:
    lines = ["| optimizer | batch | steps | peak lr | held-out loss (end) | train loss (last 10 steps) | time (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(result["runs"], key=lambda r: (r["batch"], r["optimizer"], r["lr"])):
        best = result["best"][series_of(r)]["lr"] == r["lr"]
        ev = f"**{r['final_eval']:.3f}**" if best else f"{r['final_eval']:.3f}"
        lines.append(f"| {r['optimizer']} | {r['batch']} | {r['steps']} | {r['lr']:g} | {ev} | "
                     f"{r['final_train_10']:.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def docs_body(result: dict[str, Any], verdict: str) -> str:
    """This benchmark's section of docs/benchmarks.md, below its title."""
    return "\n".join([
        "`python -m benchmarks.bench_lamb_batch`; raw: `benchmarks/results/lamb_batch.json`. The embedded default "
        f"model (gpt2-tiny) trained in one process by the engine's Trainer for {result['tokens']:,} tokens (40% of a "
        f"pass over the embedded corpus, sequences of {result['seq_len']}): AdamW at batch {result['batch']['adamw']}, "
        f"LAMB at {result['batch']['lamb']} (a quarter of the steps), and as a control AdamW at "
        f"{result['batch']['lamb']} too. Same samples in the same order; warm-up over "
        f"the first {result['warmup_fraction']:.0%} of the tokens, cosine decay to lr/10, clipping at 1.0. "
        "Learning rates, all shown: AdamW at the small batch around the default recipe (1e-3 to 4e-3, then 8e-3 "
        "added because 4e-3 was the best of the first three); LAMB's (a per-layer relative step, another unit), "
        "fixed before the runs, from the LAMB paper's 1e-2 to 1e-1, the lr whose first steps move weights as far "
        "as AdamW's at 2e-3 (2e-3 / init std 0.02); the AdamW control at the recipe's 2e-3 scaled by sqrt(4) and "
        "by 4. Held-out loss on "
        f"{result['eval_tokens']:,} bytes of text from the corpus grammar with an unseen seed. Time: wall seconds, "
        "two runs at a time on 2 cores shared with other jobs.", "",
        table(result), "",
        "![AdamW at B vs LAMB at 4B](img/lamb_batch.png)", "",
        verdict + edges(result)])


def edges(result: dict[str, Any]) -> str:
    """Which series' best learning rate lies at the end of its grid (a better one may lie beyond)."""
    out = []
    for key, b in result["best"].items():
        lrs = result["series"][key]["lrs"]
        if b["lr"] in (min(lrs), max(lrs)):
            side = "lowest" if b["lr"] == min(lrs) else "highest"
            out.append(f"{result['series'][key]['optimizer']} at batch {b['batch']} (best lr {b['lr']:g}, its "
                       f"{side})")
    return (" Best at the end of its grid, so a better lr may lie beyond: " + "; ".join(out) + ".") if out else ""


def write_docs(result: dict[str, Any], verdict: str, path: Path = harness.DOCS) -> None:
    """Replace (or append) this benchmark's section of docs/benchmarks.md, leaving other sections alone."""
    harness.write_section(path, SECTION, docs_body(result, verdict))


def verdict_of(result: dict[str, Any]) -> str:
    """A plain sentence on whether LAMB at 4B matched AdamW at B (within 0.02 nats of held-out loss)."""
    b = result["best"]
    diff = result["lamb_minus_adamw_eval"]
    head = (f"Best held-out loss: AdamW (lr {b['adamw']['lr']:g}) {b['adamw']['final_eval']:.3f}, LAMB at 4x the "
            f"batch (lr {b['lamb']['lr']:g}) {b['lamb']['final_eval']:.3f}")
    if "adamw_4b" in b:
        c = b["adamw_4b"]
        head += f", AdamW at 4x the batch (lr {c['lr']:g}) {c['final_eval']:.3f}"
    head += ": "
    if abs(diff) <= 0.02:
        return head + "LAMB at 4x the batch matches AdamW for the same tokens (within 0.02 nats), as MegaScale reports."
    if diff < 0:
        return head + f"LAMB at 4x the batch ends {-diff:.3f} nats lower than AdamW for the same tokens."
    return head + (f"LAMB at 4x the batch ends {diff:.3f} nats higher: here it does not match AdamW. With a quarter "
                   "of the steps on a tiny model and under half a pass over a small corpus, the run is limited by its "
                   "number of updates; MegaScale's claim concerns large models trained for many thousands of steps."
                   + _control_note(b))


def _control_note(best: dict[str, Any]) -> str:
    if "adamw_4b" not in best:
        return ""
    gap = best["adamw_4b"]["final_eval"] - best["lamb"]["final_eval"]
    if gap > 0.02:
        return (f" At the large batch LAMB is {gap:.3f} nats better than AdamW: what costs here is the 4x batch "
                "(a quarter of the updates), which LAMB recovers only in part.")
    if gap < -0.02:
        return f" At the large batch AdamW is {-gap:.3f} nats better than LAMB: LAMB does not help here."
    return " At the large batch LAMB and AdamW end within 0.02 nats: the cost is the 4x batch, not the optimizer."


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "a few steps per run; writes nothing")
    ap.add_argument("--workers", type=int, default=2, help="runs at a time (default 2)")
    ap.add_argument("--runs-log", help="append each finished run to this JSON-lines file")
    ap.add_argument("--from-log", help="write the results from a --runs-log file instead of training")
    args = ap.parse_args(argv)
    if args.from_log:
        runs = [json.loads(line) for line in Path(args.from_log).read_text().splitlines() if line.strip()]
        result = summarise(runs, runs[0]["steps"] * runs[0]["tokens_per_step"], held_out()[0].numel())
        args.quick = False
    else:
        result = run(quick=args.quick, workers=args.workers, runs_log=args.runs_log)
    print(table(result))
    verdict = verdict_of(result)
    print(verdict)
    if args.quick:
        return
    print(f"wrote {harness.shown(plot(result))}")
    harness.save(result, RESULTS, docs_body(result, verdict), section=SECTION)


if __name__ == "__main__":
    main()
