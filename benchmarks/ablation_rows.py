"""The ablation's rows and layouts (MegaScale's Table 3, cumulative), shared by the CPU-bound ablation
(bench_ablation), its emulated twin (ablation_emulated) and the overlap trace (overlap_trace_emulated): the run
config of every row, and every row's trainer built in one rank process."""
from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import harness, stats
from megatronapp.config import RunConfig, validate

LAYOUTS = {
    "tp=2 x dp=2": {"tp": 2, "dp": 2, "sequence_parallel": True},
    "pp=2 x dp=2": {"pp": 2, "dp": 2, "schedule": "1f1b"},
}
# (row, MegaScale's gain for it in MFU points, settings added on top of the previous row)
ROWS: list[tuple[str, str, dict[str, dict[str, Any]]]] = [
    ("baseline", "-", {"model": {"parallel_block": False, "sliding_window": None},
                       "parallel": {"dp_overlap": False, "pp_overlap": False, "tp_comm_overlap": False},
                       "train": {"data_prefetch": 0, "optimizer": "adamw"}}),
    ("+ parallel block + sliding window", "+5.6", {"model": {"parallel_block": True, "sliding_window": "quarter"}}),
    ("+ communication overlap", "+6.2", {"parallel": {"dp_overlap": True, "pp_overlap": True,
                                                      "tp_comm_overlap": "if-sp"}}),
    ("+ data pipeline", "+1.1", {"train": {"data_prefetch": 2}}),
    ("+ LAMB, 4x batch", "+3.0", {"train": {"optimizer": "lamb", "batch_x": 4}}),
    ("+ ZeRO-1 (memory)", "n/a", {"parallel": {"zero": 1}}),
]
FULL = {"hidden": 256, "layers": 4, "heads": 8, "seq": 128, "global_batch": 8, "microbatches": 2,
        "warmup": 2, "reps": 12}
QUICK = {"hidden": 32, "layers": 2, "heads": 4, "seq": 16, "global_batch": 8, "microbatches": 2,
         "warmup": 1, "reps": 2}


def row_configs(layout: dict[str, Any], size: dict[str, int],
                rows: list[tuple[str, str, dict[str, dict[str, Any]]]] | None = None) -> list[dict[str, Any]]:
    """The cumulative run config of every row (default ROWS) on one layout (a Llama: SwiGLU, RMSNorm, RoPE).
    "if-sp" turns TP overlap on only with sequence parallelism and tp > 1, "if-pp" PP overlap only with pp > 1."""
    cfg: dict[str, Any] = {
        "model": {"family": "llama", "vocab_size": 256, "hidden_size": size["hidden"], "num_layers": size["layers"],
                  "num_heads": size["heads"], "num_kv_heads": size["heads"], "max_seq_len": size["seq"]},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "microbatches": size["microbatches"], **layout},
        "train": {"steps": 10**6, "global_batch_size": size["global_batch"], "seq_len": size["seq"], "lr": 1e-3,
                  "warmup_steps": 0, "grad_clip": 1.0, "seed": 5, "progress": False, "peak_tflops": 1.0,
                  "out": str(Path(tempfile.gettempdir()) / "megatronapp-bench-ablation")},
    }
    out = []
    for _name, _gain, add in ROWS if rows is None else rows:
        for section, values in add.items():
            for key, value in values.items():
                if key == "sliding_window" and value == "quarter":
                    value = size["seq"] // 4
                if key == "tp_comm_overlap" and value == "if-sp":
                    value = bool(cfg["parallel"].get("sequence_parallel")) and cfg["parallel"]["tp"] > 1
                if key == "pp_overlap" and value == "if-pp":
                    value = cfg["parallel"]["pp"] > 1
                if key == "batch_x":  # more microbatches of the same size: 4x the tokens per step
                    cfg["train"]["global_batch_size"] = size["global_batch"] * value
                    cfg["parallel"]["microbatches"] = size["microbatches"] * value
                    continue
                cfg[section][key] = value
        out.append(copy.deepcopy(cfg))
    return out


def build_trainers(configs: list[dict[str, Any]], world: int, rank: int) -> list:
    """One trainer per row config in this rank process (comm state reset first): the rows share one launch."""
    from megatronapp.parallel import comm
    from megatronapp.train.trainer import Trainer

    comm.reset()
    trainers = []
    for c in configs:
        cfg = RunConfig.from_dict(copy.deepcopy(c))
        validate(cfg, world)
        trainers.append(Trainer(cfg, rank))
    return trainers


def rotated_steps(trainers: list, warmup: int, reps: int,
                  after_rep: Callable[[], None] | None = None) -> list[list[float]]:
    """Fenced step times per trainer over `reps` repetitions after `warmup`: each repetition steps every trainer
    once, in an order rotated every repetition, so no row always follows the same neighbour."""
    times: list[list[float]] = [[] for _ in trainers]
    for rep in range(warmup + reps):
        for i in harness.rotation(list(range(len(trainers))), rep):
            dt, _ = harness.fenced(trainers[i].train_step)
            if rep >= warmup:
                times[i].append(dt)
        if rep >= warmup and after_rep is not None:
            after_rep()
    return times


def row_records(rows: list[tuple[str, str, dict]], configs: list[dict[str, Any]], times: list[list[float]],
                peak_flops: float, **per_row: list[Any]) -> list[dict[str, Any]]:
    """Per row: tokens/s, MFU against `peak_flops`, the paired tokens/s ratio against the row above (higher is
    better: the LAMB row does 4x the tokens per step), and the `per_row` values (one list entry a row)."""
    out: list[dict[str, Any]] = []
    for i, ((name, gain, _), c) in enumerate(zip(rows, configs)):
        cfg = RunConfig.from_dict(copy.deepcopy(c))
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        tps = [tokens / t for t in times[i]]
        row = {"row": name, "megascale_mfu_gain": gain, "tokens_per_step": tokens,
               "median_step_s": statistics.median(times[i]), "tokens_per_s": statistics.median(tps),
               "mfu": statistics.median(tps) * cfg.model.flops_per_token(cfg.train.seq_len) / peak_flops,
               **{k: v[i] for k, v in per_row.items()}, "step_times_s": times[i]}
        if i:
            prev_tps = [out[-1]["tokens_per_step"] / t for t in times[i - 1]]
            row["vs_previous"] = stats.summarize_ratios(stats.paired_ratios(tps, prev_tps), lower_is_better=False)
        out.append(row)
    return out
