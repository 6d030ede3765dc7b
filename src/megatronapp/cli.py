"""The `megatronapp` command: demo, train, and the modules' sub-commands (scan, dpp, scope)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Any

from megatronapp.config import ConfigError, RunConfig, load_yaml, preset, validate

# flag -> (section, field); flags left unset keep the YAML/default value.
_TRAIN_FLAGS: dict[str, tuple[str, str]] = {
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "dp": ("parallel", "dp"), "vpp": ("parallel", "vpp"),
    "schedule": ("parallel", "schedule"), "microbatches": ("parallel", "microbatches"),
    "sequence_parallel": ("parallel", "sequence_parallel"), "dpp_policy": ("parallel", "dpp_policy"),
    "dpp_max_inflight": ("parallel", "dpp_max_inflight"), "backend": ("parallel", "backend"),
    "comm_semantics": ("parallel", "comm_semantics"), "zero": ("parallel", "zero"),
    "dp_overlap": ("parallel", "dp_overlap"), "pp_overlap": ("parallel", "pp_overlap"),
    "tp_comm_overlap": ("parallel", "tp_comm_overlap"),
    "tp_comm_overlap_chunks": ("parallel", "tp_comm_overlap_chunks"),
    "fbd": ("parallel", "fbd"), "fbd_forward_tp": ("parallel", "fbd_forward_tp"),
    "fbd_forward_pp": ("parallel", "fbd_forward_pp"), "fbd_forward_instances": ("parallel", "fbd_forward_instances"),
    "steps": ("train", "steps"), "global_batch": ("train", "global_batch_size"), "seq_len": ("train", "seq_len"),
    "lr": ("train", "lr"), "min_lr": ("train", "min_lr"), "warmup": ("train", "warmup_steps"),
    "optimizer": ("train", "optimizer"), "weight_decay": ("train", "weight_decay"),
    "grad_clip": ("train", "grad_clip"), "seed": ("train", "seed"), "dtype": ("train", "dtype"),
    "recompute": ("train", "recompute"), "save_interval": ("train", "save_interval"), "out": ("train", "out"),
    "resume": ("train", "resume"), "data": ("train", "data"), "tokenizer": ("train", "tokenizer"),
    "hf": ("train", "hf_checkpoint"), "peak_tflops": ("train", "peak_tflops"),
    "data_prefetch": ("train", "data_prefetch"), "tensorboard": ("train", "tensorboard"),
    "log_interval": ("train", "log_interval"),
    "eval_interval": ("train", "eval_interval"), "eval_iters": ("train", "eval_iters"),
    "valid_data": ("train", "valid_data"),
    "async_save": ("train", "async_save"), "keep_checkpoints": ("train", "keep_checkpoints"),
    "tf32": ("train", "tf32"),
    "family": ("model", "family"), "layers": ("model", "num_layers"), "hidden": ("model", "hidden_size"),
    "heads": ("model", "num_heads"), "kv_heads": ("model", "num_kv_heads"), "ffn_hidden": ("model", "ffn_hidden_size"),
    "vocab": ("model", "vocab_size"), "max_seq_len": ("model", "max_seq_len"),
    "make_vocab_size_divisible_by": ("model", "make_vocab_size_divisible_by"),
    "parallel_block": ("model", "parallel_block"), "sliding_window": ("model", "sliding_window"),
    "trace": ("trace", "enabled"), "trace_dir": ("trace", "dir"), "trace_interval": ("trace", "interval"),
    "trace_iterations": ("trace", "iterations"), "trace_granularity": ("trace", "granularity"),
}


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Flags of `megatronapp train` (each overrides the YAML config)."""
    g = p.add_argument_group("run")
    g.add_argument("--config", help="YAML file with sections model/parallel/train/trace")
    g.add_argument("--nproc", type=int, help="local ranks to spawn (must equal dp*pp*tp, plus the forward "
                   "ranks with --fbd; default: that number)")
    g.add_argument("--out", help="run directory: metrics.jsonl, summary.json, checkpoints/, trace/")
    g.add_argument("--resume", help="checkpoint to resume: a step directory, .../checkpoints/latest or a run dir")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live bar")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="preset: gpt2-tiny (default), llama-tiny, gpt2-small, llama-1b")
    g.add_argument("--family", choices=["gpt2", "llama"])
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-heads", type=int, help="grouped-query attention: key/value heads")
    g.add_argument("--ffn-hidden", type=int)
    g.add_argument("--vocab", type=int, help="vocabulary size (any: padded for tensor parallelism)")
    g.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="pad the vocabulary to a multiple of this times --tp (default 128, as Megatron-LM)")
    g.add_argument("--max-seq-len", type=int)
    g.add_argument("--parallel-block", action="store_true", default=None, help="attention and MLP from one norm")
    g.add_argument("--sliding-window", type=int, help="attend to at most this many previous tokens")
    g.add_argument("--hf", help="initialise from a local Hugging Face directory (GPT-2 or Llama safetensors)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, help="tensor-parallel size")
    g.add_argument("--pp", type=int, help="pipeline-parallel size")
    g.add_argument("--dp", type=int, help="data-parallel size")
    g.add_argument("--vpp", type=int, help="virtual pipeline chunks per stage")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dpp"],
                   help="zb-h1: zero-bubble 1F1B with a split backward (vpp 1); dpp: dynamic, see --dpp-policy")
    g.add_argument("--microbatches", type=int, help="microbatches per DP replica per step")
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--dpp-policy", choices=["dfs", "bfs", "adaptive", "zb"],
                   help="zb: dynamic zero-bubble (split backward; W fills the bubbles)")
    g.add_argument("--dpp-max-inflight", type=int, help="cap on activations held for backward (memory)")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"])
    g.add_argument("--comm-semantics", choices=["native", "nccl", "nccl-lazy", "nccl-eager"],
                   help="nccl: make gloo enforce the NCCL rules that always hold (catches what would hang on GPUs); "
                        "nccl-lazy / nccl-eager: plus lazy (no device_id) or eager (device_id) communicator rules")
    g.add_argument("--zero", type=int, choices=[0, 1],
                   help="1: distributed optimizer (ZeRO-1): optimizer state and fp32 masters sharded over DP")
    g.add_argument("--dp-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="all-reduce DP gradient buckets during backward (default on; off for ablations)")
    g.add_argument("--pp-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="pipeline sends overlap the next computation (default on; off: each send is waited)")
    g.add_argument("--tp-comm-overlap", action="store_true", default=None,
                   help="with --sequence-parallel: chunked TP all-gathers/reduce-scatters overlapped with the GEMMs")
    g.add_argument("--tp-comm-overlap-chunks", type=int, metavar="N",
                   help="chunks per overlapped TP collective (default 2; must divide seq_len/tp)")
    g = p.add_argument_group("MegaFBD (forward and backward on separate ranks; docs/megafbd.md)")
    g.add_argument("--fbd", action="store_true", default=None,
                   help="forward instances on extra ranks; --tp/--pp/--dp are the backward layout")
    g.add_argument("--fbd-forward-tp", type=int, help="tensor-parallel size of a forward instance (divides --tp)")
    g.add_argument("--fbd-forward-pp", type=int, help="pipeline stages of a forward instance (divides --pp)")
    g.add_argument("--fbd-forward-instances", type=int, help="forward instances (microbatch i goes to i %% n)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int)
    g.add_argument("--global-batch", type=int, help="samples per optimizer step over all DP replicas")
    g.add_argument("--seq-len", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float)
    g.add_argument("--warmup", type=int, help="warm-up steps")
    g.add_argument("--optimizer", choices=["adamw", "lamb"])
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float, help="global gradient-norm clip (0 disables)")
    g.add_argument("--seed", type=int)
    g.add_argument("--dtype", choices=["fp32", "bf16"])
    g.add_argument("--recompute", choices=["none", "selective", "full"])
    g.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="on a GPU, fp32 matmuls use TF32 tensor cores (default on; off to compare with the CPU)")
    g.add_argument("--save-interval", type=int, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--async-save", action="store_true", default=None,
                   help="two-stage checkpoints: the host-memory copy and the file writes run in the background "
                        "during the next step, whose optimizer update waits for the copy")
    g.add_argument("--keep-checkpoints", type=int, help="keep the newest N complete checkpoints (0: all)")
    g.add_argument("--log-interval", type=int)
    g.add_argument("--data", help="a .txt/.jsonl file or directory (default: the embedded corpus)")
    g.add_argument("--tokenizer", help="'byte' (default) or a path to tokenizer.json")
    g.add_argument("--peak-tflops", type=float, help="per-rank vendor peak for MFU, e.g. 989 for an H100's dense "
                   "bf16 (default: a matmul rate measured at start, labelled as such)")
    g.add_argument("--data-prefetch", type=int, metavar="N",
                   help="batches built N steps ahead by a background worker (default 2; 0: off)")
    g.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files to DIR (lead rank)")
    g.add_argument("--eval-interval", type=int, metavar="N", help="validation loss every N steps and at the end "
                   "(forward only; val_loss in metrics.jsonl, summary.json, TensorBoard; default 0: none)")
    g.add_argument("--eval-iters", type=int, metavar="K", help="held-out batches per validation (default 1)")
    g.add_argument("--valid-data", metavar="PATH", help="held-out .txt/.jsonl for validation (default: the "
                   "embedded corpus's held-out split; required with --data)")
    g = p.add_argument_group("modules")
    g.add_argument("--trace", action="store_true", default=None, help="MegaScan: trace every rank")
    g.add_argument("--trace-dir")
    g.add_argument("--trace-interval", type=int,
                   help="trace the last --trace-iterations iterations of every N (skips the warm-up step)")
    g.add_argument("--trace-iterations", type=int)
    g.add_argument("--trace-granularity", choices=["coarse", "full"])
    g.add_argument("--inject", action="append", default=[],
                   help="fault drill, repeatable: slow-compute=RANK:FACTOR, slow-link=A-B:MS, pause=RANK:MS:EVERY, "
                        "hang=RANK:STEP, slow-wire=A-B:FACTOR, jitter=A-B:lognormal:SIGMA, "
                        "kill-save=RANK:STEP:STAGE[:RESTART] (docs/resilience.md)")
    g.add_argument("--scope-port", type=int, help="MegaScope: serve the live page while training")
    g.add_argument("--emulate-device", metavar="SPEC",
                   help="emulated accelerators: each task computes, then its rank sleeps out the modelled device "
                        "time; SPEC e.g. tflops=0.001,jitter=lognormal:0.5,speed=1:0.5 (README, 'Emulated devices')")
    g = p.add_argument_group("resilience (--supervise)")
    g.add_argument("--supervise", action="store_true",
                   help="run under a driver: heartbeats, crash and hang detection naming the cause, automatic "
                        "restart from the newest intact checkpoint (docs/resilience.md)")
    g.add_argument("--hang-timeout", type=float, metavar="S",
                   help="seconds without step progress that make a hang (default: 10x the slowest step, >= 30)")
    g.add_argument("--max-restarts", type=int, default=3, help="restarts before the driver gives up (default 3)")
    g.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S",
                   help="seconds between a rank's heartbeats (default 1)")
    g.add_argument("--heartbeat-dir", metavar="DIR",
                   help="under torchrun (several hosts): beat to DIR, a directory every host sees, obey the "
                        "restart decisions of `megatronapp resilience watch`, and on a torchrun restart resume "
                        "from the newest intact checkpoint in --out with fault drills off")
    g.add_argument("--no-diagnose-on-restart", dest="diagnose_on_restart", action="store_false",
                   help="restart at once, without running the diagnostics on the job's ranks first")
    g.add_argument("--diagnose-budget", type=float, default=120.0, metavar="S",
                   help="wall-clock budget of the diagnostics before a restart (default 120)")
    g.add_argument("--spares", type=int, default=0, metavar="K",
                   help="K warm spare processes (torch and the trainer imported): a failed rank is replaced in "
                        "place, the healthy ranks keep running and no committed step is lost (default 0: restart "
                        "every rank from the newest checkpoint)")
    g.add_argument("--no-buddy-copy", dest="buddy_copy", action="store_false",
                   help="with --spares and --zero 1: no per-step copy of each rank's optimizer slice to a DP peer "
                        "(a lost rank's slice then comes from the newest checkpoint, and every rank goes back to it)")
    g.add_argument("--allow-shrink", action="store_true",
                   help="restart without the evicted rank's DP replica (dp-1, same global batch; plain "
                        "optimizer only) instead of with the same layout")
    g.add_argument("--straggler-windows", type=int, default=3, metavar="N",
                   help="with --trace: report a straggler when MegaScan names the same cause in N trace windows "
                        "in a row (default 3)")
    g.add_argument("--straggler-min-slowdown", type=float, default=1.10, metavar="F",
                   help="count only findings that slow their rank at least F-fold (default 1.10): smaller "
                        "persistent differences are reported by MegaScan but do not pay for a restart")
    g.add_argument("--evict-stragglers", action="store_true",
                   help="treat a persistent straggler rank as a failure: stop, diagnose, evict, restart")
    g.add_argument("--attach", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="plug-in by import path, repeatable: FUNCTION(trainer) is called in every rank and may "
                        "register lifecycle hooks (see docs/architecture.md, 'Plug-ins')")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults (or, with --resume and no --config, the checkpoint's own config), then --config YAML, then
    --model preset, then individual flags."""
    if getattr(args, "config", None):
        cfg = load_yaml(args.config)
    elif getattr(args, "resume", None):
        cfg = _config_of_checkpoint(args.resume, args)
    else:
        cfg = RunConfig()
    if getattr(args, "model", None):
        cfg.model = preset(args.model)
    sections: dict[str, dict[str, Any]] = {}
    for flag, (section, field) in _TRAIN_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            sections.setdefault(section, {})[field] = value
    for section, values in sections.items():
        current = dataclasses.asdict(getattr(cfg, section))
        if section == "model":
            # Derived fields must be recomputed when the shape changes (e.g. ffn size from hidden size).
            for derived in ("ffn_hidden_size", "num_kv_heads", "bias", "tie_embeddings"):
                if derived not in values and ("hidden_size" in values or "family" in values
                                              or "num_heads" in values):
                    current[derived] = None
        current.update(values)
        setattr(cfg, section, type(getattr(cfg, section))(**current))
    if getattr(args, "no_progress", False):
        cfg.train.progress = False
    if getattr(args, "inject", None):
        cfg.inject = list(cfg.inject) + list(args.inject)
    if getattr(args, "scope_port", None) is not None:
        cfg.scope_port = args.scope_port
    if getattr(args, "attach", None):
        cfg.attach = list(cfg.attach) + list(args.attach)
    if getattr(args, "emulate_device", None) is not None:  # an empty SPEC is refused by validate, not ignored
        cfg.emulate_device = args.emulate_device
    if getattr(args, "resume", None):
        _check_steps_beyond_checkpoint(args.resume, cfg.train.steps)
    return cfg


def _check_steps_beyond_checkpoint(path: str, steps: int) -> None:
    """`train --resume X` must have steps left to run: refuse a --steps at or below the checkpoint's step
    (it would load the checkpoint, train nothing and overwrite the run's summary)."""
    from megatronapp.train import checkpoint as ckpt

    try:
        done = int(ckpt.load_meta(ckpt.resolve(path))["step"])
    except (ckpt.CheckpointError, KeyError, ValueError) as e:
        raise ConfigError(f"--resume {path}: {e}") from None
    if steps <= done:
        raise ConfigError(f"--resume {path} is at step {done} and train.steps={steps}: nothing left to train; pass "
                          f"--steps with a total above {done} (steps count from the start of the job)")


# What a checkpoint decides on `train --resume DIR` (docs/resilience.md, "What a checkpoint may decide"): the
# model, the layout, the optimizer and its schedule, and what fixes the data order. Never plug-ins, fault drills,
# the console port, tracing or a path: those come from the command line or the user's --config file.
_STATE_TRAIN_FIELDS = ("steps", "global_batch_size", "seq_len", "lr", "min_lr", "warmup_steps", "optimizer",
                       "weight_decay", "beta1", "beta2", "eps", "grad_clip", "seed", "dtype", "recompute",
                       "tf32", "log_interval", "save_interval", "async_save", "data_prefetch", "peak_tflops")
# Paths a resumed run needs the same as the saved run, so the user names them again (the saved value is only shown)
_NAMED_AGAIN = {"data": ("--data", None), "tokenizer": ("--tokenizer", "byte")}


def _config_of_checkpoint(path: str, args: argparse.Namespace) -> RunConfig:
    """The state part of the run config saved with a checkpoint, so `train --resume DIR` alone continues the same
    job; the run writes into the run directory holding the checkpoint the user named, unless --out says otherwise."""
    from megatronapp.train import checkpoint as ckpt

    try:
        d = ckpt.resolve(path)
        saved = ckpt.load_meta(d)["config"]
        cfg = RunConfig.from_dict({"model": saved["model"], "parallel": saved["parallel"],
                                   "train": {k: saved["train"][k] for k in _STATE_TRAIN_FIELDS
                                             if k in saved["train"]}})
    except (ckpt.CheckpointError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {path}: {str(e)[:300]}") from None
    for name, (flag, default) in _NAMED_AGAIN.items():
        value = saved["train"].get(name, default)
        if value != default and getattr(args, name, None) is None:
            raise ConfigError(f"--resume {path}: the checkpoint was trained with train.{name}={str(value)[:200]!r}; "
                              f"pass {flag} (a checkpoint does not choose the files a resumed run reads)")
    cfg.train.out = str(d.parent.parent)  # <run>/checkpoints/step_N -> <run>
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from megatronapp.train.trainer import train

    cfg = config_from_args(args)
    if args.nproc is not None:
        validate(cfg, args.nproc)
    if cfg.inject:
        from megatronapp import faults

        for spec in cfg.inject:
            faults.parse(spec)
    if getattr(args, "supervise", False) and getattr(args, "heartbeat_dir", None):
        raise ConfigError("--supervise and --heartbeat-dir: choose one (--supervise: ranks on this host; "
                          "--heartbeat-dir: ranks started by torchrun, watched by `megatronapp resilience watch`)")
    if getattr(args, "supervise", False):
        return _train_supervised(cfg, args)
    if getattr(args, "heartbeat_dir", None):  # one rank of a multi-host job watched by `resilience watch`
        cfg = importlib.import_module("megatronapp.resilience.elastic").prepare(
            cfg, args.heartbeat_dir, args.heartbeat_interval)
    summary = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank gets here; rank 0 speaks for the job
        print(f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps; run files in {summary['out']}")
    from megatronapp.launch import exit_rank, external_launch

    if external_launch():
        exit_rank(0)  # a torchrun rank has the spawned ranks' comm threads: no interpreter finalization either
    return 0


def _train_supervised(cfg: RunConfig, args: argparse.Namespace) -> int:
    if cfg.parallel.fbd:  # the supervisor starts the engine's ranks, not MegaFBD's forward and backward roles
        raise ConfigError("--supervise does not run MegaFBD jobs yet (parallel.fbd); drop --supervise (FBD runs "
                          "still save checkpoints and take --resume) or --fbd")
    supervisor = importlib.import_module("megatronapp.resilience.supervisor")  # a module, not engine code
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        raise ConfigError(f"--hang-timeout {args.hang_timeout}: must be > 0 seconds")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.heartbeat_interval <= 0:
        raise ConfigError(f"--heartbeat-interval {args.heartbeat_interval}: must be > 0 seconds")
    if args.diagnose_budget <= 0:
        raise ConfigError(f"--diagnose-budget {args.diagnose_budget}: must be > 0 seconds")
    if args.straggler_windows < 1:
        raise ConfigError(f"--straggler-windows {args.straggler_windows}: must be >= 1")
    if args.straggler_min_slowdown < 1.0:
        raise ConfigError(f"--straggler-min-slowdown {args.straggler_min_slowdown}: must be >= 1.0 (a factor)")
    if args.spares < 0:
        raise ConfigError(f"--spares {args.spares}: must be >= 0")
    if args.evict_stragglers and not cfg.trace.enabled:
        raise ConfigError("--evict-stragglers needs --trace: stragglers are found in the MegaScan trace windows")
    opts = supervisor.Options(hang_timeout_s=args.hang_timeout, max_restarts=args.max_restarts,
                              heartbeat_s=args.heartbeat_interval, diagnose_on_restart=args.diagnose_on_restart,
                              diagnose_budget_s=args.diagnose_budget, allow_shrink=args.allow_shrink,
                              straggler_windows=args.straggler_windows, evict_stragglers=args.evict_stragglers,
                              straggler_min_slowdown=args.straggler_min_slowdown, spares=args.spares,
                              buddy_copy=args.buddy_copy)
    try:
        summary = supervisor.supervise(cfg, opts)
    except supervisor.SupervisorGaveUp as e:
        print(f"megatronapp: {e}", file=sys.stderr)
        return 1
    evicted = "".join(f"; persistent straggler {s['kind']} rank(s) {', '.join(map(str, s['ranks']))}"
                      for s in summary.get("stragglers", []))
    evicted += "".join(f"; evicted rank {e['rank']} ({e['label']})" for e in summary.get("evicted", []))
    if summary.get("dp", cfg.parallel.dp) != cfg.parallel.dp:
        evicted += f"; finished on dp={summary['dp']}"
    if summary.get("replacements"):
        evicted += f"; {len(summary['replacements'])} rank(s) replaced in place"
    print(f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps, {summary['restarts']} "
          f"restart(s){evicted}; run files in {summary['out']}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from megatronapp.demo import run_demo

    return run_demo(args)


def cmd_export(args: argparse.Namespace) -> int:
    from megatronapp.train.checkpoint import CheckpointError
    from megatronapp.train.export import export_hf

    try:
        out = export_hf(args.checkpoint, args.hf, args.tokenizer)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"megatronapp export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out} (config.json, model.safetensors, tokenizer.json); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatronapp",
        description="3D-parallel LLM training on torch.distributed, with MegaScan tracing, MegaDPP dynamic "
                    "pipelines and MegaScope live model views.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("demo", help="train the embedded default on 4 CPU ranks, then a MegaScan fault drill",
                       description="Train the embedded default model on 4 local ranks (tp=2, pp=2), then run a "
                                   "traced job with an injected slow rank and show MegaScan naming it.")
    p.add_argument("--out", default="runs/demo", help="where the demo's runs go")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--quick", action="store_true", help="fewer steps (for tests)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("train", help="train a model with tensor, pipeline and data parallelism",
                       description="Train on local ranks (spawned) or as one rank of a torchrun job.")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("export", help="write a checkpoint (any layout) as a Hugging Face directory",
                       description="Consolidate a checkpoint of any tp/pp/vpp/dp/ZeRO layout and write it as a "
                                   "transformers GPT-2 or Llama directory: config.json, model.safetensors, "
                                   "tokenizer.json and tokenizer_config.json.")
    p.add_argument("checkpoint", metavar="CKPT", help="a step directory, .../checkpoints/latest, a run directory "
                   "or a Hugging Face directory")
    p.add_argument("--hf", required=True, metavar="OUT", help="the directory to write")
    p.add_argument("--tokenizer", metavar="PATH", help="the tokenizer.json to export (a checkpoint trained with one "
                   "needs it named: a path saved in the checkpoint is not opened); default: an HF source's own, "
                   "else the byte tokenizer")
    p.set_defaults(func=cmd_export)
    sub.add_parser("torchrun", add_help=False, help="torchrun on several hosts, with what it cannot find by itself "
                   "in containers or namespaces (is_host, --local-addr, the socket interface) filled in",
                   description="Every argument goes to torchrun (see `torchrun --help`).")
    for module in ("scan", "dpp", "scope", "resilience"):
        try:
            mod = importlib.import_module(f"megatronapp.{module}.cli")
        except ModuleNotFoundError as e:
            if e.name != f"megatronapp.{module}.cli":
                raise
            continue
        mod.register(sub)
    return parser


# errors a rank reports that the user fixes (a bad file or setting, named in the message): no traceback for them
_USER_ERRORS = ("CheckpointError", "ConfigError", "HFCheckpointError", "DataError")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:  # every argument is torchrun's: its own parser reads them
        from megatronapp import multihost

        return multihost.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"megatronapp: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        checkpoint = sys.modules.get("megatronapp.train.checkpoint")  # imported only by commands that read one
        if checkpoint is not None and isinstance(e, checkpoint.CheckpointError):
            # a checkpoint that is torn, forged or missing is the user's to fix: its message names the file
            print(f"megatronapp: checkpoint error: {e}", file=sys.stderr)
            return 2
        launch = sys.modules.get("megatronapp.launch")  # imported only by commands that start ranks (torch)
        if launch is None or not isinstance(e, launch.RankFailed):
            raise
        # a rank raised or was killed: its own traceback says where (not for a bad file or setting: its message
        # names the file and the field), and the job fails with a non-zero status
        if e.tb and e.message.split(":", 1)[0] not in _USER_ERRORS:
            print(e.tb, file=sys.stderr, end="")
        print(f"megatronapp: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megatronapp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
