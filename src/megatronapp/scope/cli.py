"""`megatronapp scope serve`: the MegaScope page for the embedded default model, an HF directory or a checkpoint."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatronapp.scope.security import Guard, resolve_token

if TYPE_CHECKING:  # the model imports torch (6 s): `megatronapp scan ...` builds this parser too and needs none
    from megatronapp.scope.generate import ScopeModel


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `scope` command and its `serve` sub-command."""
    p = subparsers.add_parser("scope", help="MegaScope: watch a model generate, live in the browser",
                              description="Watch a model's internals live in the browser and inject perturbations.")
    sub = p.add_subparsers(dest="scope_command", metavar="SUBCOMMAND")
    s = sub.add_parser("serve", help="serve the page (default: the embedded tiny model, no download)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=0, help="port (0: pick a free one)")
    s.add_argument("--token", help="require this token (the printed URL carries it); default: $MEGASCOPE_TOKEN, "
                                   "else a random one when --host is not loopback")
    s.add_argument("--no-token", action="store_true",
                   help="require no token (refused off loopback unless --insecure)")
    s.add_argument("--insecure", action="store_true",
                   help="allow --no-token on a non-loopback --host (a trusted network only)")
    s.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="also accept browser requests from this origin (e.g. https://notebook.example:8888)")
    s.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also accept requests addressed to this host name (e.g. behind a reverse proxy)")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--hf", metavar="DIR", help="a local Hugging Face GPT-2 or Llama directory")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a megatronapp checkpoint (any tp/pp layout: consolidated into one model)")
    s.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json to read the model's ids with (a checkpoint "
                   "trained with one needs it named: a path saved in the checkpoint is not opened)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1): layers split in stages")
    s.add_argument("--nproc", type=int, default=1, help="local processes (gloo ranks) to serve from (= tp x pp)")
    s.add_argument("--max-request-mb", type=float, default=None, metavar="MB",
                   help="refuse a generation whose captures would exceed this many MB (default 512)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where a model served by one process runs (default cpu; cuda: the current GPU)")
    s.set_defaults(func=cmd_serve)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    g = subparsers.add_parser("generate", help="continue a prompt with a trained or exported model, streaming",
                              description="Generate text from a megatronapp checkpoint (any layout) or a Hugging "
                                          "Face directory, printing tokens as they come. Uses MegaScope's "
                                          "generation (scope/generate.py) with nothing captured.")
    g.add_argument("source", metavar="CKPT_OR_HF_DIR",
                   help="a checkpoint (step directory, .../checkpoints/latest or a run directory) or an HF directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0, help="0 (or --greedy): always the likeliest token")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens holding this mass")
    g.add_argument("--greedy", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json to use (a checkpoint trained with one needs "
                   "it named: a path saved in the checkpoint is not opened)")
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a continuation of --prompt to stdout; the prompt first, then each new token as it is placed."""
    from pydantic import ValidationError

    from megatronapp.scope.generate import generate
    from megatronapp.scope.protocol import Generate
    from megatronapp.train.checkpoint import CheckpointError

    try:
        req = Generate(type="generate", prompts=[args.prompt], max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                       seed=args.seed)
    except ValidationError as e:
        bad = "; ".join(f"--{'-'.join(map(str, x['loc'])).replace('_', '-')}: {x['msg']}" for x in e.errors())
        print(f"megatronapp generate: {bad}", file=sys.stderr)
        return 2
    src = Path(args.source)
    hf = src.is_dir() and (src / "config.json").is_file() and not (src / "meta.json").is_file()
    try:
        sm = load_model(argparse.Namespace(hf=str(src) if hf else None, checkpoint=None if hf else str(src),
                                           tokenizer=args.tokenizer))
    except (CheckpointError, OSError, ValueError) as e:  # ConfigError (a bad HF directory) is a ValueError
        print(f"megatronapp generate: {e}", file=sys.stderr)
        return 2
    new: list[int] = []
    shown = [0]
    sys.stdout.write(args.prompt)

    def emit(msg: dict) -> None:
        for row in msg.get("next", []):
            if row["new"]:
                new.append(row["id"])
        text = sm.tokenizer.decode(new).rstrip("\ufffd")  # a character still missing bytes waits for them
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = max(shown[0], len(text))

    try:
        generate(sm, req, emit)
    except ValueError as e:  # the request does not fit the model (prompt too long, ids out of vocabulary)
        print(f"\nmegatronapp generate: {e}", file=sys.stderr)
        return 2
    tail = sm.tokenizer.decode(new)[shown[0]:]
    sys.stdout.write(tail + "\n")
    return 0


def load_model(args: argparse.Namespace) -> ScopeModel:
    """The model named by --hf / --checkpoint, else the embedded default."""
    from megatronapp.data.tokenizer import ByteTokenizer, load_tokenizer
    from megatronapp.scope.generate import ScopeModel

    if args.hf:
        from megatronapp.model.hf import load_hf_model

        d = Path(args.hf)
        cfg, model = load_hf_model(d)
        model.eval()
        return ScopeModel(model, cfg, load_tokenizer(getattr(args, "tokenizer", None) or str(d)), name=d.name)
    if args.checkpoint:
        return _from_checkpoint(Path(args.checkpoint), getattr(args, "tokenizer", None))
    from megatronapp.scope.default_model import load_default_model

    model, cfg, meta = load_default_model()
    return ScopeModel(model, cfg, ByteTokenizer(), name="embedded gpt2-tiny", meta=meta)


def _from_checkpoint(path: Path, tokenizer: str | None = None) -> ScopeModel:
    """Load a trainer checkpoint of any layout (tp/pp/vpp shards are consolidated into one model)."""
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.scope.generate import ScopeModel
    from megatronapp.train import checkpoint as ckpt
    from megatronapp.train.consolidate import checkpoint_config, tokenizer_spec
    from megatronapp.train.consolidate import load_model as load_consolidated

    d = ckpt.resolve(path)
    _, run = checkpoint_config(d)
    tok = load_tokenizer(tokenizer_spec(d, run, tokenizer))
    model = load_consolidated(d)
    model.eval()
    return ScopeModel(model, run.model, tok, name=str(d))


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    from megatronapp.scope.server import serve

    if getattr(args, "scope_command", None) != "serve":
        print("usage: megatronapp scope serve [--host H] [--port P] [--token T] [--hf DIR | --checkpoint DIR] "
              "[--tp N] [--pp N] [--nproc TPxPP]",
              file=sys.stderr)
        return 2
    from megatronapp.train.checkpoint import CheckpointError

    try:
        args.token = resolve_token(args.token, args.host, args.insecure, no_token=args.no_token)
        if args.max_request_mb is not None and args.max_request_mb <= 0:
            raise ValueError(f"--max-request-mb {args.max_request_mb}: give a positive number of MB")
    except ValueError as e:
        print(f"megatronapp scope: {e}", file=sys.stderr)
        return 2
    device_error = _device_error(args)
    if device_error:
        print(f"megatronapp scope: {device_error}", file=sys.stderr)
        return 2
    if args.tp != 1 or args.pp != 1 or args.nproc != 1:
        return _serve_parallel(args)
    try:
        sm = load_model(args)
    except (OSError, ValueError, CheckpointError) as e:  # ConfigError (bad HF dir) is a ValueError
        print(f"megatronapp scope: {e}", file=sys.stderr)
        return 2
    _apply_budget(sm, args)
    _place(sm, getattr(args, "device", "cpu"))
    serve(sm, host=args.host, port=args.port, token=args.token, announce=lambda s: print(s, flush=True),
          insecure=args.insecure, guard=guard_of(args))
    return 0


def guard_of(args: argparse.Namespace) -> Guard:
    """The Host/Origin rules the flags ask for."""
    return Guard(bind_host=args.host, allowed_hosts=args.allow_host, allowed_origins=args.allow_origin)


def _apply_budget(sm: ScopeModel, args: argparse.Namespace) -> None:
    if args.max_request_mb is not None:
        sm.max_request_bytes = int(args.max_request_mb * 2**20)


def _device_error(args: argparse.Namespace) -> str | None:
    """Why --device cannot be honoured here, or None."""
    if getattr(args, "device", "cpu") != "cuda":
        return None
    import torch

    if args.tp != 1 or args.pp != 1 or args.nproc != 1:
        return ("--device cuda serves the model from one process, while --tp/--pp/--nproc > 1 serve from gloo "
                "CPU ranks: drop those flags or use --device cpu")
    if not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False); use --device cpu"
    return None


def _place(sm: ScopeModel, device: str) -> None:
    """Move the served model to `device`; its name then says where it runs (the page's `hello` shows it)."""
    if device == "cpu":
        return
    sm.model.to(device)
    sm.name = f"{sm.name} on {device}"


def _serve_parallel(args: argparse.Namespace) -> int:
    """Check the layout and the model's divisibility, then serve from --nproc gloo ranks (rank 0 serves)."""
    from megatronapp.launch import spawn
    from megatronapp.scope import distributed
    from megatronapp.train.checkpoint import CheckpointError

    try:
        distributed.check_parallel(args.tp, args.pp, args.nproc)
        cfg, source = distributed.model_config(args.hf, args.checkpoint)
        distributed.check_divisible(cfg, args.tp, source, args.pp)
        if args.hf or args.checkpoint:  # refused here, not in every rank
            distributed.tokenizer_of(args.hf, args.checkpoint, getattr(args, "tokenizer", None))
    except (OSError, ValueError, CheckpointError) as e:
        print(f"megatronapp scope: {e}", file=sys.stderr)
        return 2
    spawn(distributed.serve_rank, args.nproc,
          {"hf": args.hf, "checkpoint": args.checkpoint, "tp": args.tp, "pp": args.pp, "host": args.host,
           "port": args.port, "token": args.token, "insecure": args.insecure, "allow_host": args.allow_host,
           "allow_origin": args.allow_origin, "tokenizer": getattr(args, "tokenizer", None),
           "max_request_bytes": int(args.max_request_mb * 2**20) if args.max_request_mb else None})
    return 0
