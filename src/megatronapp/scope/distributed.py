"""MegaScope serving a tensor-parallel model from several ranks (`megatronapp scope serve --tp N --nproc N`).

Rank 0 runs the web server exactly as in one process. Every generation it accepts is broadcast to the other
ranks, which wait in `worker_loop` and run the same `generate` in lockstep, so the TP collectives inside the
model and the `Recorder` (which gathers sharded captures into full tensors) match up. Every rank samples with
the same seed from the same gathered logits, so all pick the same tokens. Only rank 0 emits messages.

Lockstep is kept by one rule: every rank makes the same collective calls in the same order. So the decision to
stop (the browser's `stop`, or a browser that went away) is taken by rank 0 and broadcast at the top of every
step, and rank 0 never leaves a generation early on its own: a failed send is remembered and turned into that
stop. Requests are validated identically on every rank before the first collective of a generation, so a bad
request fails everywhere at the same point. Perturbations of TP-sharded values (weights, and q/k/v/probs) are
refused under tp > 1: each rank would draw its random elements over its own shard, not the full tensor, which
would not match the single-process result.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ModelConfig
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group, Topology
from megatronapp.scope.generate import Emit, ScopeModel, generate
from megatronapp.scope.protocol import Generate

SHARDED_POINTS = ("attn.q", "attn.k", "attn.v", "attn.probs")  # head-split across TP ranks
_SHUTDOWN = ("shutdown", None)


def check_parallel(tp: int, pp: int, nproc: int) -> None:
    """Refuse layouts MegaScope cannot serve: only tensor parallelism, one rank per TP shard."""
    if pp != 1:
        raise ValueError(f"--pp {pp}: MegaScope serves tensor-parallel models only; use --pp 1 and "
                         f"--tp N --nproc N")
    if tp < 1 or nproc < 1:
        raise ValueError(f"--tp {tp} --nproc {nproc}: both must be >= 1")
    if nproc != tp:
        raise ValueError(f"--nproc {nproc} must equal --tp {tp} (one process per tensor-parallel shard; "
                         f"pipeline and data parallelism are not served)")


def check_divisible(cfg: ModelConfig, tp: int, source: str) -> None:
    """Raise naming the field when `cfg` cannot be split `tp` ways (heads, kv heads, ffn; the vocabulary is
    padded to a multiple of tp)."""
    fields = {"num_heads": cfg.num_heads, "num_kv_heads": int(cfg.num_kv_heads),
              "ffn_hidden_size": int(cfg.ffn_hidden_size)}
    bad = [f"{k}={v}" for k, v in fields.items() if v % tp]
    if bad:
        raise ValueError(f"{source}: {', '.join(bad)} not divisible by --tp {tp}; choose a --tp dividing them")


def model_config(hf: str | None) -> tuple[ModelConfig, str]:
    """The config of the model to serve (an HF directory, else the embedded default) and a name for errors."""
    if hf:
        from megatronapp.model.hf import config_from_hf

        return config_from_hf(Path(hf)), f"--hf {hf}"
    import json

    from megatronapp.scope.default_model import ASSETS, META

    return ModelConfig(**json.loads((ASSETS / META).read_text())["model"]), "the embedded default model"


def load_shard(hf: str | None, topo: Topology) -> ScopeModel:
    """This rank's TP shard of the model (HF directory or embedded default), with the logit-lens weight."""
    from megatronapp.data.tokenizer import ByteTokenizer, load_tokenizer
    from megatronapp.model.transformer import TransformerChunk
    from megatronapp.parallel.tensor_parallel import shard

    cfg, _ = model_config(hf)
    chunk = TransformerChunk(cfg, 0, cfg.num_layers, True, True, tp_group=topo.tp_group)
    if hf:
        from megatronapp.model.hf import load_hf_weights

        load_hf_weights(chunk, hf)
        tokenizer, name, meta = load_tokenizer(hf), Path(hf).name, {}
    else:
        from safetensors.torch import load_file

        from megatronapp.scope.default_model import ASSETS, WEIGHTS, load_default_model

        _, _, meta = load_default_model()  # checks the files and reads the training metadata
        full = load_file(str(ASSETS / WEIGHTS))
        with torch.no_grad():
            for n, p in chunk.named_parameters():
                p.copy_(shard(full[n].float(), p, topo.tp_group))
        tokenizer, name = ByteTokenizer(), "embedded gpt2-tiny"
    chunk.eval()
    sm = ScopeModel(chunk, cfg, tokenizer, name=f"{name} (tp={topo.tp})", meta=meta)
    if topo.tp > 1:
        # the logit lens unembeds on one rank, so it needs every vocab slice of the output weight
        sm.lens_weight = comm.all_gather(chunk.output_weight().detach(), topo.tp_group, dim=0)
    return sm


def refuse_sharded_perturbations(req: Generate, tp: int) -> None:
    """Under tp > 1, refuse perturbations that would act on one shard instead of the full tensor."""
    if tp == 1:
        return
    for p in req.perturbations:
        if not p.enabled:
            continue
        if p.place == "weight":
            raise ValueError(f"weight perturbations are not supported when serving with --tp {tp} (each rank "
                             f"holds a slice); serve with --tp 1, or perturb an activation or the hidden state")
        if p.place == "activation" and p.target in SHARDED_POINTS:
            raise ValueError(f"perturbing {p.target} is not supported when serving with --tp {tp} (its heads are "
                             f"split across ranks); serve with --tp 1, or perturb in, attn.out, mlp.out or out")


class _LockstepCancel:
    """`is_set()` for generate's per-step check: rank 0 decides, every rank gets the same answer."""

    def __init__(self, world: Group, local: threading.Event | None = None, failed: list | None = None):
        self.world, self.local, self.failed = world, local, failed

    def is_set(self) -> bool:
        mine = bool(self.failed) or (self.local is not None and self.local.is_set())
        return bool(comm.broadcast_object(mine, 0, self.world))


def lockstep_runner(topo: Topology) -> Any:
    """Rank 0's stand-in for `generate`: broadcast the request, then generate in lockstep with the workers."""
    world = topo.groups["world"]

    def run(sm: ScopeModel, req: Generate, emit: Emit, cancel: threading.Event | None = None) -> dict[str, Any]:
        refuse_sharded_perturbations(req, topo.tp)  # before the broadcast: the workers never see it
        comm.broadcast_object(("generate", req.model_dump(mode="json")), 0, world)
        failed: list[BaseException] = []

        def safe_emit(msg: dict[str, Any]) -> None:
            # leaving mid-generation would strand the workers in a collective: remember the failure, stop next step
            if failed:
                return
            try:
                emit(msg)
            except Exception as e:  # noqa: BLE001  (re-raised below, once every rank has stopped)
                failed.append(e)

        result = generate(sm, req, safe_emit, _LockstepCancel(world, cancel, failed))
        if failed:
            raise failed[0]
        return result

    return run


def worker_loop(sm: ScopeModel, topo: Topology) -> int:
    """Ranks other than 0: run each broadcast generation in lockstep until shutdown; returns how many ran."""
    world, runs = topo.groups["world"], 0
    cancel = _LockstepCancel(world)
    while True:
        kind, payload = comm.broadcast_object(None, 0, world)  # type: ignore[misc]
        if kind == "shutdown":
            return runs
        runs += 1
        try:
            generate(sm, Generate.model_validate(payload), lambda msg: None, cancel)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            pass  # rank 0 raised the same error at the same point and reported it to the browser


def shutdown(topo: Topology) -> None:
    """Rank 0: end the workers' loops."""
    comm.broadcast_object(_SHUTDOWN, 0, topo.groups["world"])


def serve_rank(rank: int, world_size: int, opts: dict[str, Any]) -> None:
    """`launch.spawn` target: rank 0 serves the page until interrupted, the others follow its generations."""
    from megatronapp.parallel import topology
    from megatronapp.scope.server import serve

    topo = topology.build(world_size, 1, 1)
    sm = load_shard(opts.get("hf"), topo)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops rank 0's server, which then shuts us down
        worker_loop(sm, topo)
        return
    sm.runner = lockstep_runner(topo)
    try:
        serve(sm, host=opts["host"], port=opts["port"], token=opts.get("token"),
              announce=lambda s: print(s, flush=True))
    finally:
        shutdown(topo)
