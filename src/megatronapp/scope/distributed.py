"""MegaScope serving a model split over several ranks: `megatronapp scope serve --tp T --pp P --nproc T*P`.

Rank 0 runs the web server exactly as in one process. Every generation it accepts is broadcast to the other
ranks, which wait in `worker_loop` and run the same `generate` in lockstep. Each rank holds its TP shard of its
pipeline stage's layers (a `TransformerChunk`) and a KV cache for those layers only. A step runs the stages in
order: stage s receives the hidden state of the new positions from stage s-1 (`comm.recv` on the one-way
`pp.act.up` channel: activations only ever flow up, so no receive can block a send, see pipeline/p2p.py),
runs its layers and sends on; the last stage's TP ranks hold the gathered logits of the last position and the
first of them broadcasts them to every rank, so every rank samples the same token with the same seed. Captures
are gathered over TP by the `Recorder` and merged over the stages of rank 0's pipeline column onto rank 0
(`collect_pipeline`), which alone builds and sends messages; the logit lens uses a full copy of the final norm
and output weight held by rank 0.

Lockstep is kept by one rule: every rank makes the same collective calls in the same order. Once per step
(`Lockstep.sync`) the ranks all-reduce a small flag vector: which ranks failed in the previous step (any
exception: a bad request, NaN in sampling, a bug) and whether rank 0 wants to stop (the browser's `stop`, or a
browser that went away). A failure on any rank then ends the generation on every rank at the same step; the
first failed rank broadcasts its error, which rank 0 reports to the page, and the workers wait for the next
request. Errors raised in the middle of a forward on one rank only (between two collectives of a step) cannot be
caught this way: the others would wait in that collective (see docs/megascope.md, Not done).
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ModelConfig
from megatronapp.model.transformer import KVCache, TransformerChunk
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology
from megatronapp.scope.capture import collect_pipeline
from megatronapp.scope.generate import Emit, ScopeModel, generate
from megatronapp.scope.protocol import Generate

_SHUTDOWN = ("shutdown", None)


class RankError(RuntimeError):
    """An error raised on another serving rank, reported by rank 0."""


def check_parallel(tp: int, pp: int, nproc: int) -> None:
    """Refuse layouts MegaScope cannot serve: one process per (tp, pp) shard, no data parallelism."""
    if tp < 1 or pp < 1 or nproc < 1:
        raise ValueError(f"--tp {tp} --pp {pp} --nproc {nproc}: all must be >= 1")
    if nproc != tp * pp:
        raise ValueError(f"--nproc {nproc} must equal --tp {tp} x --pp {pp} = {tp * pp} (one process per shard; "
                         f"data parallelism is not served)")


def check_divisible(cfg: ModelConfig, tp: int, source: str, pp: int = 1) -> None:
    """Raise naming the field when `cfg` cannot be split `tp` ways (heads, kv heads, ffn; the vocabulary is
    padded to a multiple of tp)."""
    fields = {"num_heads": cfg.num_heads, "num_kv_heads": int(cfg.num_kv_heads),
              "ffn_hidden_size": int(cfg.ffn_hidden_size)}
    bad = [f"{k}={v}" for k, v in fields.items() if v % tp]
    if bad:
        raise ValueError(f"{source}: {', '.join(bad)} not divisible by --tp {tp}; choose a --tp dividing them")
    if cfg.num_layers < pp:
        raise ValueError(f"{source}: num_layers={cfg.num_layers} < --pp {pp}; every stage needs a layer, use a "
                         f"--pp of at most {cfg.num_layers}")


def model_config(hf: str | None, checkpoint: str | None = None) -> tuple[ModelConfig, str]:
    """The config of the model to serve (an HF directory, a checkpoint, else the embedded default) and a name
    for errors."""
    if hf:
        from megatronapp.model.hf import check_tensors, config_from_hf

        cfg = config_from_hf(Path(hf))
        check_tensors(Path(hf), cfg)  # before any rank allocates its shard
        return cfg, f"--hf {hf}"
    if checkpoint:
        from megatronapp.train import checkpoint as ckpt
        from megatronapp.train.consolidate import checkpoint_config

        _, run = checkpoint_config(ckpt.resolve(checkpoint))
        return run.model, f"--checkpoint {checkpoint}"
    import json

    from megatronapp.scope.default_model import ASSETS, META

    return ModelConfig(**json.loads((ASSETS / META).read_text())["model"]), "the embedded default model"


def load_shard(hf: str | None, topo: Topology, checkpoint: str | None = None,
               tokenizer: str | None = None) -> ScopeModel:
    """This rank's shard (its TP slice of its stage's layers) of an HF directory, a checkpoint or the embedded
    default model; rank 0 also gets the full final norm and output weight for the logit lens."""
    from megatronapp.data.tokenizer import ByteTokenizer, load_tokenizer
    from megatronapp.partition import split_layers

    cfg, _ = model_config(hf, checkpoint)
    stage = topo.coord.pp
    lo, hi = split_layers(cfg.num_layers, topo.pp)[stage]
    tp_group = topo.tp_group if topo.tp > 1 else None
    chunk = TransformerChunk(cfg, lo, hi, stage == 0, stage == topo.pp - 1, tp_group=tp_group)
    load = _loader(hf, checkpoint, topo)
    load(chunk)
    if hf or checkpoint:
        tok, meta = load_tokenizer(tokenizer_of(hf, checkpoint, tokenizer)), {}
        name = Path(hf).name if hf else str(checkpoint)
    else:
        from megatronapp.scope.default_model import load_default_model

        _, _, meta = load_default_model()  # checks the files and reads the training metadata
        tok, name = ByteTokenizer(), "embedded gpt2-tiny"
    chunk.eval()
    layout = f"tp={topo.tp}" + (f", pp={topo.pp}" if topo.pp > 1 else "")
    sm = ScopeModel(chunk, cfg, tok, name=f"{name} ({layout})", meta=meta)
    if topo.world_size > 1:
        sm.lockstep = Lockstep(topo, chunk)
    if topo.pp > 1:
        if topo.rank == 0:
            # the logit lens runs on rank 0 (stage 0): it needs the last stage's final norm and whole output weight
            head = TransformerChunk(cfg, cfg.num_layers, cfg.num_layers, False, True)
            load(head)
            sm.lens_weight, sm.lens_norm = head.output_weight().detach(), head.final_norm.eval()
    elif topo.tp > 1:
        # the logit lens unembeds on one rank, so it needs every vocab slice of the output weight
        sm.lens_weight = comm.all_gather(chunk.output_weight().detach(), topo.tp_group, dim=0)
    return sm


def _loader(hf: str | None, checkpoint: str | None, topo: Topology) -> Any:
    """A function filling a chunk's parameters (its TP slice when the chunk has a tp group) from the source."""
    if hf:
        from megatronapp.model.hf import load_hf_weights

        return lambda chunk: load_hf_weights(chunk, hf)
    if checkpoint:
        from megatronapp.scope.checkpoint_shards import load_checkpoint_shard

        return lambda chunk: load_checkpoint_shard(checkpoint, chunk, topo.coord.tp if chunk.tp_group else None)
    from safetensors.torch import load_file

    from megatronapp.parallel.tensor_parallel import shard
    from megatronapp.scope.default_model import ASSETS, WEIGHTS

    full = load_file(str(ASSETS / WEIGHTS))

    def load(chunk: TransformerChunk) -> None:
        with torch.no_grad():
            for n, p in chunk.named_parameters():
                src = full[n] if n in full else full[chunk.init_name(n)]  # a last stage's copy of tied weights
                p.copy_(shard(src.float(), p, chunk.tp_group))
    return load


def tokenizer_of(hf: str | None, checkpoint: str | None, given: str | None) -> str:
    """The tokenizer spec to serve with: the user's, an HF directory's own, or what a checkpoint's run used when
    that is the byte tokenizer (a saved path is not opened on the checkpoint's word: `tokenizer_spec`)."""
    if given is not None or hf:
        return given or str(hf)
    from megatronapp.train import checkpoint as ckpt
    from megatronapp.train.consolidate import checkpoint_config, tokenizer_spec

    d = ckpt.resolve(checkpoint)
    return tokenizer_spec(d, checkpoint_config(d)[1], None)


class Lockstep:
    """How the ranks of a tp x pp serving job run one generation step together (see the module docstring)."""

    def __init__(self, topo: Topology, chunk: TransformerChunk):
        self.topo, self.world = topo, topo.groups["world"]
        self.emitter = topo.rank == 0
        ref = next(chunk.parameters())
        self.device, self.dtype = ref.device, ref.dtype
        self.logits_src = topo.rank_at(0, topo.pp - 1, 0)  # first TP rank of the last stage

    def sync(self, err: BaseException | None, stop: bool) -> bool:
        """Exchange failures and rank 0's stop wish; raise on every rank if any rank failed."""
        n = self.topo.world_size
        flags = torch.zeros(n + 1, device=self.device)  # on the backend's device (NCCL takes CUDA tensors)
        if err is not None:
            flags[self.topo.rank] = 1.0
        if stop and self.emitter:
            flags[n] = 1.0
        comm.all_reduce(flags, self.world, op="max", label="scope step")
        failed = [r for r in range(n) if flags[r] > 0]
        if failed:
            src = failed[0]
            mine = None if err is None else (type(err).__name__, str(err)[:2000],
                                             isinstance(err, ValueError | TypeError))
            kind, text, user = comm.broadcast_object(mine if self.topo.rank == src else None, src,  # type: ignore[misc]
                                                     self.world)
            if self.topo.rank == src:
                raise err  # type: ignore[misc]
            if user:
                raise ValueError(text)  # the same bad request on every rank: report it as such
            raise RankError(f"rank {src} failed: {kind}: {text}")
        return bool(flags[n] > 0)

    def forward(self, model: TransformerChunk, ids: torch.Tensor, cache: KVCache, start_pos: int) -> torch.Tensor:
        """Run this stage's layers on the new positions; every rank returns the last position's logits [b, v]."""
        topo = self.topo
        if topo.pp == 1:
            return model(ids, kv_cache=cache, start_pos=start_pos)[:, -1]  # TP ranks all hold gathered logits
        b, s = ids.shape
        me, prev, nxt = topo.rank, topo.prev_rank(), topo.next_rank()
        stage = topo.coord.pp
        if stage == 0:
            x = ids
        else:
            x = torch.empty(b, s, model.cfg.hidden_size, dtype=self.dtype, device=self.device)
            comm.recv(x, prev, topo.channel("act", prev, me))  # type: ignore[arg-type]
        out = model(x, kv_cache=cache, start_pos=start_pos)
        if stage < topo.pp - 1:
            comm.send(out.contiguous(), nxt, topo.channel("act", me, nxt))  # type: ignore[arg-type]
            logits = torch.empty(b, model.cfg.vocab_size, dtype=torch.float32, device=self.device)
        else:
            logits = out[:, -1].float().contiguous()
        return comm.broadcast(logits, self.logits_src, self.world)

    def collect(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's captures merged on rank 0 (its pipeline column only: other TP columns hold the same)."""
        if self.topo.pp == 1 or self.topo.coord.tp != 0:
            return states if self.emitter else {}
        merged = collect_pipeline(states, self.topo.pp_group, 0, self.topo.rank)
        return merged if merged is not None else {}

    def attach(self, perturber: Any) -> None:
        perturber.attach()


def lockstep_runner(topo: Topology) -> Any:
    """Rank 0's stand-in for `generate`: broadcast the request, then generate in lockstep with the workers."""
    world = topo.groups["world"]

    def run(sm: ScopeModel, req: Generate, emit: Emit, cancel: threading.Event | None = None) -> dict[str, Any]:
        comm.broadcast_object(("generate", req.model_dump(mode="json")), 0, world)
        return generate(sm, req, emit, cancel)

    return run


def worker_loop(sm: ScopeModel, topo: Topology) -> int:
    """Ranks other than 0: run each broadcast generation in lockstep until shutdown; returns how many ran."""
    world, runs = topo.groups["world"], 0
    while True:
        kind, payload = comm.broadcast_object(None, 0, world)  # type: ignore[misc]
        if kind == "shutdown":
            return runs
        runs += 1
        try:
            generate(sm, Generate.model_validate(payload), None)
        except Exception:  # noqa: BLE001, S110  (every rank raised at the same step; rank 0 reported it)
            pass


def shutdown(topo: Topology) -> None:
    """Rank 0: end the workers' loops."""
    comm.broadcast_object(_SHUTDOWN, 0, topo.groups["world"])


def serve_rank(rank: int, world_size: int, opts: dict[str, Any]) -> None:
    """`launch.spawn` target: rank 0 serves the page until interrupted, the others follow its generations."""
    from megatronapp.parallel import topology
    from megatronapp.scope.security import Guard
    from megatronapp.scope.server import serve

    if opts.get("semantics"):
        comm.set_semantics(opts["semantics"])
    topo = topology.build(opts.get("tp", world_size), opts.get("pp", 1), 1)
    sm = load_shard(opts.get("hf"), topo, opts.get("checkpoint"), opts.get("tokenizer"))
    if opts.get("max_request_bytes"):
        sm.max_request_bytes = opts["max_request_bytes"]
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops rank 0's server, which then shuts us down
        worker_loop(sm, topo)
        return
    sm.runner = lockstep_runner(topo)
    try:
        serve(sm, host=opts["host"], port=opts["port"], token=opts.get("token"),
              announce=lambda s: print(s, flush=True), insecure=opts.get("insecure", False),
              guard=Guard(opts["host"], opts.get("allow_host", ()), opts.get("allow_origin", ())))
    finally:
        shutdown(topo)
