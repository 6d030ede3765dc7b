"""GPU-style PyTorch profiler (Kineto) traces of a pipelined data-parallel job, with injected faults: test data for
the GPU reader and detector on a machine without a GPU.

Each rank's trace (its events written by kineto_events.py) has what a GPU job's `torch.profiler` trace holds
(field by field as in the public traces of Holistic Trace Analysis and PyTorch 2.x with NCCL 2.2x;
tests/test_scan_gpu_traces.py checks it): `ProfilerStep#N` on the host, `cpu_op`s (`aten::*`,
`record_param_comms`) around `cuda_runtime` launches, `ac2g` flow events from launch to kernel, kernels on a
compute stream (cuBLAS GEMMs, flash attention, elementwise and layer-norm kernels) and NCCL kernels on their own
streams (`ncclDevKernel_AllReduce_Sum_f32_RING_LL`, `ncclDevKernel_SendRecv`) with the collective's args
(`Collective name`, sizes, dtype, process group name, description and ranks, `Seq`, and `Src Rank` / `Dst Rank`
for point-to-point), memcpys and memsets, and `distributedInfo` with every process group.

The job: pp stages x dp replicas (Megatron's rank order: a stage's replicas are consecutive), 1F1B over
`microbatches`, each stage `layers` transformer layers (attention and MLP kernels), activations and gradients
sent between stages, the gradients all-reduced over each stage's data-parallel group, then the optimizer. The
host launches ahead of the device and waits for it once an iteration (the loss read back). A kernel starts when
its stream, its inputs and its launch allow; an NCCL kernel ends together on every member, its cost after the
last member started (so waiting for a late peer is inside the kernel, as on hardware). Hosts of 8 ranks share a
clock; hosts' clocks are seconds apart.

Faults (`--fault`, repeatable): `slow-compute=R:F` (R's kernels F times longer: the device is late),
`late-arrival=R:MS` (R's data loader takes MS longer every iteration: the host is late), `pause=R:MS[:EVERY[:WHERE]]`
(in every EVERY-th iteration, from the first; WHERE `host`: the host stops MS before the first forward,
`device`: that forward's first kernel takes MS longer), `slow-link=A-B:F` (transfers between pipeline neighbours A
and B take F times longer), `hang=R:IT` (R's host stops in iteration IT before launching anything: everyone else
ends up waiting in a collective or a receive that never finishes; no step from IT on closes).
"""
from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatronapp.scan.synth.kineto_events import RANKS_PER_HOST, US, document
from megatronapp.scan.synth.simulate import Fault, one_f_one_b, parse_fault

KINDS = ("slow-compute", "late-arrival", "pause", "slow-link", "hang")
# (cpu op, kernel name, share of the layer's forward time); the backward runs each at twice the cost
_ATTN = [("aten::native_layer_norm", "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::"
          "BFloat16, float>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, "
          "float*, c10::BFloat16*)", 0.05),
         ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
          "segment_k_off_kernel__5x_cublas", 0.2),
         ("aten::_flash_attention_forward", "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, "
          "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, "
          "true, false, false, true, true, false, false>(Flash_fwd_params)", 0.25)]
_MLP = [("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize256x128x64_warpgroupsize2x1x1_execute_"
         "segment_k_off_kernel__5x_cublas", 0.3),
        ("aten::gelu", "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::"
         "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() "
         "const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::GeluCUDAKernelImpl(at::"
         "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() "
         "const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>)", 0.2)]
_OPTIM = ("Optimizer.step#AdamW.step", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
          "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<"
          "float, 4, (at::native::ADAM_MODE)1, false>, bool, float const*, double, double, double, double, double, "
          "bool, double const*, double const*>(at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::"
          "(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, bool, float "
          "const*, double, double, double, double, double, bool, double const*, double const*)")
_STREAMS = {"compute": 7, "tp": 20, "send": 24, "recv": 28, "dp": 32}


@dataclass(frozen=True)
class GpuFault(Fault):
    """One injected fault (simulate.Fault's fields), and where a pause is and the iteration a rank hangs in."""

    where: str = "host"  # a pause: of the host or of the device
    iteration: int = 0  # a hang: the iteration the rank stops in (counted from the first traced one)

    def label(self) -> str:
        """A short human form."""
        if self.kind == "hang":
            return f"hang {self.ranks[0]} in iteration {self.iteration}"
        return super().label() + (f" ({self.where})" if self.kind == "pause" else "")


def parse_gpu_fault(spec: str) -> GpuFault:
    """Parse one `--fault` of a GPU-style job (the forms in this module's docstring): simulate's kinds, a pause's
    `:host` / `:device`, and `hang=RANK:ITERATION`."""
    kind, sep, arg = spec.partition("=")
    if not sep or kind not in KINDS:
        raise ValueError(f"--fault {spec!r}: expected KIND=ARGS with KIND one of {', '.join(KINDS)}")
    p = arg.split(":")
    if kind == "hang":
        try:
            return GpuFault(kind, (int(p[0]),), iteration=int(p[1]))
        except (ValueError, IndexError):
            raise ValueError(f"--fault {spec!r}: hang takes RANK:ITERATION") from None
    where = "host"
    if kind == "pause" and len(p) > 3:
        if p[3] not in ("host", "device"):
            raise ValueError(f"--fault {spec!r}: a pause is of the host or of the device")
        where, arg = p[3], ":".join(p[:3])
    if kind == "pause" and len(p) == 2:
        arg += ":1"  # every iteration unless said (simulate's default is every other)
    f = parse_fault(f"{kind}={arg}")
    return GpuFault(f.kind, f.ranks, f.factor, f.ms, f.every, where=where)


@dataclass
class GpuJob:
    """The generated traces (one Kineto document per rank) and what was injected."""

    docs: list[dict]
    pp: int
    dp: int
    iterations: int
    faults: list[GpuFault] = field(default_factory=list)

    def write(self, out_dir: str | Path, compress: bool = False) -> list[Path]:
        """One file per rank, named as torch.profiler's tensorboard handler names them."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for r, doc in enumerate(self.docs):
            p = out / (f"rank{r}.{1000 + r}.pt.trace.json" + (".gz" if compress else ""))
            data = json.dumps(doc).encode()
            p.write_bytes(gzip.compress(data, 6) if compress else data)
            paths.append(p)
        # What was injected, beside the traces (not as *.json: every JSON file here is read as a trace)
        (out / "ground_truth.txt").write_text(f"pp {self.pp} dp {self.dp}\n" + "".join(
            f"{f.label()}\n" for f in self.faults))
        return paths


@dataclass
class _Op:
    """One host-issued operation of a rank's program (times in ns, filled in by the simulation)."""

    kind: str  # step, host, kernel, memcpy, nccl, sync
    name: str = ""
    cpu: str = ""
    stream: int = 7
    dur: int = 0
    deps: tuple[int, ...] = ()
    it: int = -1
    coll: str = ""
    key: tuple = ()
    pg: int = -1
    peer: int = -1
    nelems: int = 0
    dtype: str = "Float"
    seq: int = -1
    cost: int = 0
    host_ts: int = -1
    host_end: int = -1
    start: int = -1
    end: int = -1


def generate(ranks: int, pp: int, iterations: int = 6, microbatches: int | None = None, layers: int = 2,
             faults: list[str] | list[GpuFault] = (), seed: int = 0, first_step: int = 10) -> GpuJob:
    """Simulate a pp x dp GPU job and return its Kineto traces (see the module docstring)."""
    if ranks % pp or ranks < pp:
        raise ValueError(f"{ranks} ranks do not split into {pp} pipeline stages")
    dp = ranks // pp
    m = microbatches or 2 * pp
    fl = [f if isinstance(f, GpuFault) else parse_gpu_fault(f) for f in faults]
    for f in fl:
        if any(not 0 <= r < ranks for r in f.ranks):
            raise ValueError(f"fault {f.label()}: rank out of range for {ranks} ranks")
        if f.kind == "slow-link" and abs(f.ranks[0] // dp - f.ranks[1] // dp) != 1 and \
                f.ranks[0] % dp == f.ranks[1] % dp:
            raise ValueError(f"fault {f.label()}: not pipeline neighbours")
    rng = np.random.default_rng(seed)
    pgs = _process_groups(ranks, pp, dp)
    progs = [_program(r, pp, dp, m, layers, iterations, first_step, fl, pgs, rng) for r in range(ranks)]
    _simulate(progs, pgs, fl, rng, ranks)
    offsets = rng.uniform(-5e9, 5e9, size=(ranks + RANKS_PER_HOST - 1) // RANKS_PER_HOST).astype(np.int64)
    docs = [document(r, ranks, progs[r], pgs, int(offsets[r // RANKS_PER_HOST]) + 1_700_000_000 * 10**9)
            for r in range(ranks)]
    return GpuJob(docs, pp, dp, iterations, fl)


def _process_groups(ranks: int, pp: int, dp: int) -> list[tuple[str, list[int]]]:
    """(description, ranks) of every process group, created world first, then the pipelines, then the DP groups."""
    out = [("default_pg", list(range(ranks)))]
    out += [("PIPELINE_MODEL_PARALLEL_GROUP", [s * dp + d for s in range(pp)]) for d in range(dp)]
    out += [("DATA_PARALLEL_GROUP", [s * dp + d for d in range(dp)]) for s in range(pp)]
    return out


def _program(r: int, pp: int, dp: int, m: int, layers: int, iterations: int, first: int, faults: list[GpuFault],
             pgs: list, rng: np.random.Generator) -> list[_Op]:
    """Rank r's operations in host order, with nominal device durations (noise and faults applied)."""
    s, d = divmod(r, dp)
    pp_pg, dp_pg = 1 + d, 1 + dp + s
    speed = float(rng.lognormal(0, 0.01))  # healthy devices differ a little, for good
    slow = math.prod(f.factor for f in faults if f.kind == "slow-compute" and f.ranks == (r,))
    late = sum(f.ms for f in faults if f.kind == "late-arrival" and f.ranks == (r,))
    pauses = [f for f in faults if f.kind == "pause" and f.ranks == (r,)]
    hang = min([f.iteration for f in faults if f.kind == "hang" and f.ranks == (r,)], default=None)
    layer_ms = 2.0  # a layer's forward on one microbatch
    ops: list[_Op] = []

    def kernel(cpu: str, name: str, ms: float, it: int, deps: tuple[int, ...] = ()) -> int:
        ns = int(ms * 1e6 * speed * slow * rng.lognormal(0, 0.02))
        ops.append(_Op("kernel", name, cpu, _STREAMS["compute"], ns, deps, it))
        return len(ops) - 1

    def nccl(coll: str, stream: str, pg: int, nelems: int, key: tuple, it: int, deps: tuple[int, ...],
             peer: int = -1, cost_ms: float = 0.0) -> int:
        ops.append(_Op("nccl", coll=coll, stream=_STREAMS[stream], pg=pg, nelems=nelems, key=key, it=it, deps=deps,
                       peer=peer, cost=int(cost_ms * 1e6 * rng.lognormal(0, 0.03)), dtype="BFloat16" if stream in
                       ("send", "recv") else "Float"))
        return len(ops) - 1

    act = 4 << 20  # activation elements of one microbatch
    order = one_f_one_b(pp, m)[s]
    for i in range(iterations):
        it = first + i
        if hang is not None and i >= hang:
            ops.append(_Op("host", "", dur=-1, it=it))  # stuck in its own code: nothing more is launched
            break
        ops.append(_Op("step", f"ProfilerStep#{it}", it=it))
        ops.append(_Op("host", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
                       dur=int((0.3 + late) * 1e6 * rng.lognormal(0, 0.1)), it=it))
        ops.append(_Op("memcpy", "Memcpy HtoD (Pinned -> Device)", "aten::copy_", dur=int(0.05e6), it=it))
        last = len(ops) - 1
        first_forward = True
        for kind, j in order:
            deps: tuple[int, ...] = (last,)
            if kind == "F" and s > 0:
                deps = (nccl("recv", "recv", pp_pg, act, ("act", r - dp, r, it, j), it, (), peer=r - dp,
                             cost_ms=0.3),)
            if kind == "B" and s < pp - 1:
                deps = (nccl("recv", "recv", pp_pg, act, ("grad", r + dp, r, it, j), it, (), peer=r + dp,
                             cost_ms=0.3),)
            for p in pauses:
                if kind == "F" and first_forward and i % p.every == 0 and p.where == "host":
                    ops.append(_Op("host", "", dur=int(p.ms * 1e6), it=it))  # the host stops: no event
            scale = 1.0 if kind == "F" else 2.0
            for _ in range(layers):
                for cpu, name, share in _ATTN + _MLP:
                    last = kernel(cpu, name, layer_ms * share * scale, it, deps)
                    deps = ()
                    if first_forward and kind == "F":
                        for p in pauses:
                            if i % p.every == 0 and p.where == "device":
                                ops[last].dur += int(p.ms * 1e6)
                        first_forward = False
            if kind == "F" and s < pp - 1:
                nccl("send", "send", pp_pg, act, ("act", r, r + dp, it, j), it, (last,), peer=r + dp, cost_ms=0.3)
            if kind == "B" and s > 0:
                nccl("send", "send", pp_pg, act, ("grad", r, r - dp, it, j), it, (last,), peer=r - dp, cost_ms=0.3)
        if dp > 1:
            last = nccl("allreduce", "dp", dp_pg, 50 << 20, ("dp", s, it), it, (last,),
                        cost_ms=2 * (dp - 1) / dp * 3.0)
        last = kernel(_OPTIM[0], _OPTIM[1], 1.5, it, (last,))
        ops.append(_Op("sync", "aten::item", it=it))
        ops.append(_Op("step", f"ProfilerStep#{it}", it=it, key=("end",)))
    return ops


def _simulate(progs: list[list[_Op]], pgs: list, faults: list[GpuFault], rng: np.random.Generator,
              ranks: int) -> None:
    """Fill in host and device times: each rank runs until it needs an NCCL op's end not yet known; an NCCL op's
    end is known once every member has started it. What never resolves (a hang) keeps start or end -1."""
    slow_links = {frozenset(f.ranks): f.factor for f in faults if f.kind == "slow-link"}
    pc = [0] * ranks
    host = [0] * ranks
    free: list[dict[int, int]] = [{} for _ in range(ranks)]
    started: dict[tuple, list[tuple[int, int]]] = {}  # instance -> (rank, op index) of members that started it
    members: dict[tuple, int] = {}
    stopped = [False] * ranks
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            ops = progs[r]
            while pc[r] < len(ops) and not stopped[r]:
                op = ops[pc[r]]
                if op.kind == "step":
                    op.host_ts = op.host_end = host[r]
                elif op.kind == "host":
                    if op.dur < 0:
                        stopped[r] = True  # a hang: this host never comes back
                        break
                    op.host_ts, host[r] = host[r], host[r] + op.dur
                    op.host_end = host[r]
                elif op.kind == "sync":
                    pending = [o for o in ops[:pc[r]] if o.kind in ("kernel", "memcpy", "nccl") and o.end < 0]
                    if pending:
                        break
                    done = max([o.end for o in ops[:pc[r]] if o.end >= 0], default=host[r])
                    op.host_ts, host[r] = host[r] + 20 * US, max(host[r] + 40 * US, done + 15 * US)
                    op.host_end = host[r]
                else:
                    if op.host_ts < 0:  # launched once, whatever the device does
                        op.host_ts = host[r] + 4 * US
                        op.host_end = op.host_ts + (30 if op.kind == "nccl" else 14) * US
                        host[r] = op.host_end + 3 * US
                    dep_end = [ops[d].end for d in op.deps]
                    if any(e < 0 for e in dep_end) or free[r].get(op.stream, 0) < 0:
                        break  # waits for an NCCL op whose end is not known yet
                    op.start = max([op.host_end + 5 * US, free[r].get(op.stream, 0)] + dep_end)
                    if op.kind == "nccl":
                        free[r][op.stream] = -1
                        inst = op.key if op.coll not in ("send", "recv") else op.key
                        started.setdefault(inst, []).append((r, pc[r]))
                        members[inst] = 2 if op.coll in ("send", "recv") else len(pgs[op.pg][1])
                        if len(started[inst]) == members[inst]:
                            _resolve(progs, started[inst], free, slow_links, rng)
                    else:
                        op.end = op.start + op.dur
                        free[r][op.stream] = op.end
                pc[r] += 1
                progress = True


def _resolve(progs: list[list[_Op]], who: list[tuple[int, int]], free: list[dict[int, int]],
             slow_links: dict, rng: np.random.Generator) -> None:
    """Every member started the instance: it ends together, its cost after the last start."""
    ops = [progs[r][i] for r, i in who]
    cost = max(o.cost for o in ops)
    if ops[0].coll in ("send", "recv"):
        cost = int(cost * slow_links.get(frozenset(r for r, _ in who), 1.0))
    end = max(o.start for o in ops) + cost
    for (r, _), o in zip(who, ops):
        o.end = end + int(rng.integers(0, 3 * US))  # members see the end a few us apart
        free[r][o.stream] = o.end
