"""The loss plot of a run: training loss per step (and its 10-step median) beside the validation loss.

Written by the trainer to `<out>/loss.png` when a run evaluates (`--eval-interval`), and by the demo. matplotlib
is imported here only, when a plot is drawn.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from megatronapp.train.metrics import read_metrics


def loss_curve(metrics: str | Path, png: str | Path, title: str = "") -> Path:
    """Plot `metrics.jsonl`'s training loss, its 10-step median and (if logged) `val_loss` into `png`. A step
    logged twice (a run resumed after a failure replays steps) keeps its last record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = {int(r["step"]): r for r in read_metrics(metrics) if "step" in r and "loss" in r}
    steps = sorted(by_step)
    losses = [by_step[s]["loss"] for s in steps]
    med = [statistics.median(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
    evals = [(s, by_step[s]["val_loss"]) for s in steps if "val_loss" in by_step[s]]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, losses, lw=0.8, label="training loss")
    ax.plot(steps, med, lw=1.5, label="median of 10 steps")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", lw=1.5, ms=3, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png)
    plt.close(fig)
    return png
