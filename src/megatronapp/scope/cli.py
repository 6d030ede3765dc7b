"""`megatronapp scope serve`: the MegaScope page for the embedded default model, an HF directory or a checkpoint."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatronapp.scope.generate import ScopeModel


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `scope` command and its `serve` sub-command."""
    p = subparsers.add_parser("scope", help="MegaScope: watch a model generate, live in the browser",
                              description="Watch a model's internals live in the browser and inject perturbations.")
    sub = p.add_subparsers(dest="scope_command", metavar="SUBCOMMAND")
    s = sub.add_parser("serve", help="serve the page (default: the embedded tiny model, no download)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=0, help="port (0: pick a free one)")
    s.add_argument("--token", help="require this token (the printed URL carries it)")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--hf", metavar="DIR", help="a local Hugging Face GPT-2 or Llama directory")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a megatronapp checkpoint (any tp/pp layout: consolidated into one model)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1); needs --nproc equal to it")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel size: only 1 is served")
    s.add_argument("--nproc", type=int, default=1, help="local processes (gloo ranks) to serve from (= --tp)")
    s.set_defaults(func=cmd_serve)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def load_model(args: argparse.Namespace) -> ScopeModel:
    """The model named by --hf / --checkpoint, else the embedded default."""
    from megatronapp.data.tokenizer import ByteTokenizer, load_tokenizer

    if args.hf:
        from megatronapp.model.hf import config_from_hf, load_hf_weights
        from megatronapp.model.transformer import build_model

        d = Path(args.hf)
        cfg = config_from_hf(d)
        model = build_model(cfg)
        load_hf_weights(model, d)
        model.eval()
        return ScopeModel(model, cfg, load_tokenizer(str(d)), name=d.name)
    if args.checkpoint:
        return _from_checkpoint(Path(args.checkpoint))
    from megatronapp.scope.default_model import load_default_model

    model, cfg, meta = load_default_model()
    return ScopeModel(model, cfg, ByteTokenizer(), name="embedded gpt2-tiny", meta=meta)


def _from_checkpoint(path: Path) -> ScopeModel:
    """Load a trainer checkpoint of any layout (tp/pp/vpp shards are consolidated into one model)."""
    from megatronapp.config import RunConfig
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.train import checkpoint as ckpt
    from megatronapp.train.consolidate import load_model as load_consolidated

    d = ckpt.resolve(path)
    run = RunConfig.from_dict(ckpt.load_meta(d)["config"])
    model = load_consolidated(d)
    model.eval()
    return ScopeModel(model, run.model, load_tokenizer(run.train.tokenizer), name=str(d))


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    from megatronapp.scope.server import serve

    if getattr(args, "scope_command", None) != "serve":
        print("usage: megatronapp scope serve [--host H] [--port P] [--token T] [--hf DIR | --checkpoint DIR] "
              "[--tp N --nproc N]",
              file=sys.stderr)
        return 2
    from megatronapp.train.checkpoint import CheckpointError

    if args.tp != 1 or args.pp != 1 or args.nproc != 1:
        return _serve_parallel(args)
    try:
        sm = load_model(args)
    except (OSError, ValueError, CheckpointError) as e:  # ConfigError (bad HF dir) is a ValueError
        print(f"megatronapp scope: {e}", file=sys.stderr)
        return 2
    serve(sm, host=args.host, port=args.port, token=args.token, announce=lambda s: print(s, flush=True))
    return 0


def _serve_parallel(args: argparse.Namespace) -> int:
    """Check the layout and the model's divisibility, then serve from --nproc gloo ranks (rank 0 serves)."""
    from megatronapp.launch import spawn
    from megatronapp.scope import distributed

    try:
        distributed.check_parallel(args.tp, args.pp, args.nproc)
        if args.checkpoint:
            raise ValueError(f"--checkpoint {args.checkpoint}: tensor-parallel serving takes --hf DIR or the "
                             f"embedded default model; serve a checkpoint with --tp 1")
        cfg, source = distributed.model_config(args.hf)
        distributed.check_divisible(cfg, args.tp, source)
    except (OSError, ValueError) as e:
        print(f"megatronapp scope: {e}", file=sys.stderr)
        return 2
    spawn(distributed.serve_rank, args.nproc,
          {"hf": args.hf, "host": args.host, "port": args.port, "token": args.token})
    return 0
