"""Run configuration as dataclasses: model, parallelism, training and optional modules.

A config comes from defaults, then a YAML file, then CLI flags. `validate()` refuses impossible
combinations before any process starts, naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatronapp import flops
from megatronapp.device_spec import check_spec
from megatronapp.errors import ConfigError


@dataclass
class ModelConfig:
    """Decoder-only transformer shape. `family` sets norm/position/activation defaults."""

    family: str = "gpt2"  # gpt2 (LayerNorm, learned positions, GELU) | llama (RMSNorm, RoPE, SwiGLU, GQA)
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # grouped-query attention; None means num_heads
    ffn_hidden_size: int | None = None  # None: 4*h for gpt2, Llama's 8/3*h rounded to 32
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bias: bool | None = None  # None: True for gpt2, False for llama
    tie_embeddings: bool | None = None  # None: True for gpt2, False for llama
    parallel_block: bool = False  # attention and MLP read one norm (PaLM / MegaScale)
    sliding_window: int | None = None  # attend to at most this many previous tokens
    init_std: float = 0.02
    # Embedding and output rows are vocab_size rounded up to a multiple of this times tp (Megatron-LM's
    # --make-vocab-size-divisible-by): equal TP slices and GEMM-friendly shapes. 1 pads only to a multiple of tp.
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.family not in ("gpt2", "llama"):
            raise ConfigError(f"model.family={self.family!r}: choose 'gpt2' or 'llama'")
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"model.make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be "
                              f">= 1 (1 pads the vocabulary only to a multiple of parallel.tp)")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.bias is None:
            self.bias = self.family == "gpt2"
        if self.tie_embeddings is None:
            self.tie_embeddings = self.family == "gpt2"
        if self.ffn_hidden_size is None:
            if self.family == "gpt2":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 32 * ((8 * self.hidden_size // 3 + 31) // 32)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding and output layer at tensor-parallel size `tp`: vocab_size rounded up to a
        multiple of make_vocab_size_divisible_by * tp. Ids >= vocab_size are padding, masked in loss and sampling."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied); counted in flops.py."""
        return flops.num_params(self)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (forward + backward) as PaLM (appendix B) and MegaScale count them:
        6N + 12*L*H*Q*T, N the weights that take part in a matmul (flops.py says what counts and why)."""
        return flops.flops_per_token(self, seq_len)


@dataclass
class ParallelConfig:
    """How ranks are laid out: tp (fastest), dp, pp; and the pipeline schedule."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1  # virtual pipeline chunks per stage (interleaved schedules)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zb-h1 | dpp
    microbatches: int = 1  # per DP replica per step
    dpp_policy: str = "adaptive"  # dfs | bfs | adaptive | zb (schedule=dpp)
    dpp_max_inflight: int | None = None  # cap on forward-done, backward-pending microbatch chunks
    grad_bucket_mb: float = 4.0  # DP gradient bucket size
    # 1: distributed optimizer (ZeRO-1): gradients reduce-scattered, optimizer state sharded over DP
    zero: int = 0
    # Communication overlap (MegaScale section 3.3), on by default; off only for ablations and debugging.
    dp_overlap: bool = True  # all-reduce a DP gradient bucket during backward as soon as it is complete
    pp_overlap: bool = True  # pipeline sends proceed while the stage computes on (off: each send is waited)
    # TP overlap (Megatron's --tp-comm-overlap): with sequence parallelism, the all-gather before and the
    # reduce-scatter after the parallel GEMMs go in chunks along the sequence, each overlapped with a GEMM
    tp_comm_overlap: bool = False
    tp_comm_overlap_chunks: int = 2  # chunks per collective; must divide the local sequence (seq_len / tp)
    backend: str = "auto"  # auto | gloo | nccl
    # native: the backend's own rules; nccl: gloo enforces NCCL's (order-matched P2P, one stream per pair,
    # identical collective order), so a CPU run fails where a GPU job would hang
    comm_semantics: str = "native"
    # MegaFBD (docs/megafbd.md): forward instances on extra ranks; tp/pp/dp above are the backward layout
    fbd: bool = False
    fbd_forward_tp: int = 1
    fbd_forward_pp: int = 1
    fbd_forward_instances: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def total_ranks(self) -> int:
        """Ranks a job starts: the engine layout, plus MegaFBD's forward instances when fbd is on."""
        forward = self.fbd_forward_instances * self.fbd_forward_tp * self.fbd_forward_pp if self.fbd else 0
        return self.world_size + forward


@dataclass
class TraceConfig:
    enabled: bool = False
    dir: str | None = None  # default: <out>/trace
    interval: int = 10  # trace `iterations` iterations every `interval`
    iterations: int = 3
    granularity: str = "coarse"  # coarse | full (per layer)


@dataclass
class TrainConfig:
    steps: int = 50
    global_batch_size: int = 8  # samples per optimizer step over all DP replicas
    seq_len: int = 64
    # The default recipe trains the embedded default model without loss spikes (3e-3 after a 5-step warm-up
    # jumped from 3.2 to 8.7 at step 11): tests/test_recipe.py checks the rule on a short run.
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    optimizer: str = "adamw"  # adamw | lamb
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables
    seed: int = 1234
    dtype: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 master weights and gradient reduction)
    recompute: str = "none"  # none | selective | full
    tf32: bool = True  # fp32 matmuls on a GPU use TF32 tensor cores (gpu_setup.math_modes); no effect on the CPU
    log_interval: int = 1
    save_interval: int = 0  # 0: only at the end
    async_save: bool = False  # two-stage: snapshot to host memory, write in the background
    keep_checkpoints: int = 0  # keep the newest N complete steps (0: all)
    out: str = "runs/default"
    resume: str | None = None
    data: str | None = None  # None: embedded corpus; else a .txt / .jsonl file or directory
    tokenizer: str = "byte"  # byte | path to a tokenizer.json
    hf_checkpoint: str | None = None  # initialise from a local Hugging Face directory
    peak_tflops: float | None = None  # MFU denominator; None: measured at start-up
    data_prefetch: int = 2  # steps of batches built ahead by a background worker (0: build in the step)
    tensorboard: str | None = None  # directory for TensorBoard event files (None: none written)
    # validation: loss on a held-out split every eval_interval steps (0: never) over eval_iters batches;
    # valid_data None: the embedded corpus's held-out text (required with train.data)
    eval_interval: int = 0
    eval_iters: int = 1
    valid_data: str | None = None
    progress: bool = True


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    inject: list[str] = field(default_factory=list)  # fault injection specs, see megatronapp.faults
    scope_port: int | None = None
    attach: list[str] = field(default_factory=list)  # plug-ins by import path "pkg.mod:fn" (train/plugins.py)
    # Emulated devices (device_spec.py): "tflops=T,jitter=lognormal:S,speed=RANKS:FACTOR,..."
    emulate_device: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RunConfig:
        """Build from nested dicts, rejecting unknown keys by name."""
        sections = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "trace": TraceConfig}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in sections:
                if not isinstance(value, dict):
                    raise ConfigError(f"config section {key!r} must be a mapping, got {type(value).__name__}")
                kwargs[key] = _build(sections[key], value, key)
            elif key == "attach":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"attach must be a list of import paths like 'package.module:function', "
                                      f"got {_short(value)}")
                kwargs[key] = value
            elif key == "inject":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"inject must be a list of fault specs like 'hang=2:10', got {_short(value)}")
                kwargs[key] = value
            elif key in ("scope_port", "emulate_device"):
                check_type(key, "int | None" if key == "scope_port" else "str | None", value)
                kwargs[key] = value
            else:
                known = sorted([*sections, "inject", "scope_port", "attach", "emulate_device"])
                raise ConfigError(f"unknown config section {key!r}; known: {known}")
        return RunConfig(**kwargs)


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(f'{section}.{u}' for u in unknown)}; "
                          f"known fields of {section}: {sorted(fields)}")
    for name, value in values.items():
        check_type(f"{section}.{name}", str(fields[name].type), value)
    return cls(**values)


# Annotation words -> the Python types a YAML value of that field may have. bool is excluded from int and float
# (YAML's `yes` must not become tp=1), an int is accepted where a float is expected.
_TYPE_WORDS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                                            "None": (type(None),)}


def check_type(field_name: str, annotation: str, value: Any) -> None:
    """Refuse a config value whose type does not match its field's annotation ("int", "float | None", ...)."""
    words = [w.strip() for w in annotation.split("|")]
    if any(w not in _TYPE_WORDS for w in words):
        return  # a container or custom type: its own constructor checks it
    allowed = tuple(t for w in words for t in _TYPE_WORDS[w])
    if isinstance(value, bool) and bool not in allowed:
        ok = False
    else:
        ok = isinstance(value, allowed)
    if not ok:
        names = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                 "None": "null"}
        want = " or ".join(names[w] for w in words)
        hint = ""
        if isinstance(value, str) and "float" in words:
            hint = " (YAML reads 3e-4 as text: write 3.0e-4)"
        raise ConfigError(f"{field_name} must be {want}, got {_short(value)} ({type(value).__name__}){hint}")


MAX_YAML_VALUES = 100_000  # a run config holds a few hundred values; YAML aliases can make a tiny file expand


def _short(value: Any) -> str:
    """A value for an error message: bounded however large (or alias-expanded) it is."""
    import reprlib

    return reprlib.repr(value)[:200]


def _check_expanded_size(data: Any, path: Path) -> None:
    """Refuse a document whose values, aliases expanded, number more than MAX_YAML_VALUES (a "billion laughs"
    alias bomb): counted before anything walks or prints it."""
    seen, stack = 0, [data]
    while stack:
        x = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise ConfigError(f"config file {path} expands to more than {MAX_YAML_VALUES} values (YAML aliases "
                              f"repeating a value?); write the config out plainly")
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def load_yaml(path: str | Path) -> RunConfig:
    """Read a YAML config file; errors name the file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"config file {p} is not valid YAML: {str(e)[:300]}") from None
    _check_expanded_size(data, p)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections (model, parallel, train, ...)")
    return RunConfig.from_dict(data)


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dpp")


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    """Refuse impossible configurations with a message naming the field and the fix."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name, value in (("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.dp", p.dp),
                        ("parallel.vpp", p.vpp), ("parallel.microbatches", p.microbatches)):
        if value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")
    if p.zero not in (0, 1):
        raise ConfigError(f"parallel.zero={p.zero}: choose 0 (optimizer state on every DP rank) or 1 (sharded over "
                          f"DP, the distributed optimizer)")
    if p.zero and p.fbd:  # MegaFBD's weight hand-off and backward loop use the whole-state optimizer
        raise ConfigError("parallel.zero=1 does not combine with parallel.fbd: MegaFBD's backward ranks keep whole "
                          "optimizer state; drop --zero 1 or --fbd")
    if p.fbd:
        _validate_fbd(p)
    _validate_eval(cfg)
    if world_size is not None and p.fbd and world_size != p.total_ranks:
        raise ConfigError(f"world size {world_size} != {p.total_ranks} ranks = dp*pp*tp = {p.world_size} backward + "
                          f"fbd_forward_instances*fbd_forward_pp*fbd_forward_tp = {p.total_ranks - p.world_size} "
                          f"forward; set --nproc {p.total_ranks}")
    if world_size is not None and not p.fbd and world_size != p.world_size:
        raise ConfigError(f"world size {world_size} != dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = {p.world_size}; "
                          f"set --nproc {p.world_size} or change --dp/--pp/--tp")
    validate_model(m)
    if m.num_heads % p.tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by parallel.tp={p.tp}; "
                          f"choose tp from {[d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]}")
    if m.num_kv_heads % p.tp:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} is not divisible by parallel.tp={p.tp}")
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tp={p.tp}")
    stages = p.pp * p.vpp
    if m.num_layers < stages:
        raise ConfigError(f"model.num_layers={m.num_layers} < pp*vpp = {p.pp}*{p.vpp} = {stages} pipeline chunks; "
                          f"lower --pp/--vpp or add layers")
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={p.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if p.vpp > 1 and p.schedule in ("gpipe", "1f1b", "zb-h1"):
        raise ConfigError(f"parallel.vpp={p.vpp} needs an interleaved schedule: use --schedule interleaved-1f1b or dpp")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1")
    if p.comm_semantics not in ("native", "nccl", "nccl-lazy", "nccl-eager"):
        raise ConfigError(f"parallel.comm_semantics={p.comm_semantics!r}: choose native, nccl, nccl-lazy or "
                          f"nccl-eager")
    if p.comm_semantics != "native" and p.backend == "nccl":
        raise ConfigError(f"parallel.comm_semantics={p.comm_semantics!r} emulates NCCL's rules on gloo; with "
                          f"--backend nccl the rules hold natively: use --comm-semantics native")
    if p.dpp_policy not in ("dfs", "bfs", "adaptive", "zb"):
        raise ConfigError(f"parallel.dpp_policy={p.dpp_policy!r}: choose dfs, bfs, adaptive or zb")
    if p.dpp_max_inflight is not None and p.dpp_max_inflight < max(1, p.vpp):
        # a stage must be able to hold one microbatch through all of its chunks (see docs/megadpp.md)
        raise ConfigError(f"parallel.dpp_max_inflight={p.dpp_max_inflight} is below the minimum "
                          f"{max(1, p.vpp)} (= vpp, one microbatch through every chunk of a stage)")
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError(f"train.seq_len={t.seq_len} must be divisible by parallel.tp={p.tp} "
                          "with sequence parallelism")
    if p.tp_comm_overlap and not (p.sequence_parallel and p.tp > 1):
        raise ConfigError(f"parallel.tp_comm_overlap overlaps the sequence-parallel collectives, but parallel.tp="
                          f"{p.tp} and sequence_parallel={p.sequence_parallel}: add --sequence-parallel with --tp > 1, "
                          f"or drop --tp-comm-overlap")
    if p.tp_comm_overlap and (p.tp_comm_overlap_chunks < 1 or (t.seq_len // p.tp) % p.tp_comm_overlap_chunks):
        raise ConfigError(f"parallel.tp_comm_overlap_chunks={p.tp_comm_overlap_chunks} must be >= 1 and divide the "
                          f"local sequence length seq_len/tp = {t.seq_len}/{p.tp} = {t.seq_len // p.tp}")
    if t.global_batch_size % (p.dp * p.microbatches):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be divisible by "
                          f"dp*microbatches = {p.dp}*{p.microbatches}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.optimizer not in ("adamw", "lamb"):
        raise ConfigError(f"train.optimizer={t.optimizer!r}: choose adamw or lamb")
    if t.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"train.dtype={t.dtype!r}: choose fp32 or bf16")
    if t.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"train.recompute={t.recompute!r}: choose none, selective or full")
    if t.keep_checkpoints < 0:
        raise ConfigError(f"train.keep_checkpoints={t.keep_checkpoints} must be >= 0 (0 keeps every checkpoint)")
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps} must be >= 1")
    if t.data_prefetch < 0:
        raise ConfigError(f"train.data_prefetch={t.data_prefetch} must be >= 0 (steps built ahead; 0 turns "
                          f"prefetching off)")
    if cfg.trace.granularity not in ("coarse", "full"):
        raise ConfigError(f"trace.granularity={cfg.trace.granularity!r}: choose coarse or full")
    if cfg.emulate_device is not None:  # the longest task of one microbatch bounds the modelled device time
        tasks = flops.virtual_stage_flops(m, t.seq_len, micro_batch_size(cfg) * t.seq_len, p.pp, p.vpp, p.tp,
                                          t.recompute)
        check_spec(cfg.emulate_device, world_size or p.total_ranks, task_flops=max(f + b + w for f, b, w in tasks))


_MODEL_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                "max_seq_len")


def validate_model(m: ModelConfig) -> None:
    """Refuse a model shape that cannot be built (sizes, head divisibility), naming the field: the check a model
    read from a file (a checkpoint's meta.json, a Hugging Face config.json) gets before anything is allocated."""
    for name in _MODEL_SIZES:
        value = getattr(m, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{name}={_short(value)} must be a positive integer")
    for name in ("norm_eps", "rope_theta"):
        value = getattr(m, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"model.{name}={_short(value)} must be a positive finite number")
    if m.sliding_window is not None and (isinstance(m.sliding_window, bool) or not isinstance(m.sliding_window, int)
                                         or m.sliding_window < 1):
        raise ConfigError(f"model.sliding_window={_short(m.sliding_window)} must be a positive integer or null")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
    if m.family == "llama" and m.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dim; hidden_size/num_heads = {m.head_dim}")


# The modules' entry points, switched on by their own flags. Strings, not imports: the engine never imports a
# module; each rank resolves these by import path (megatronapp.train.plugins).
TRACE_PLUGIN = "megatronapp.scan.record.tracer:plugin"
INJECT_PLUGIN = "megatronapp.faults:plugin"
SCOPE_PLUGIN = "megatronapp.scope.training:plugin"
FBD_TRAIN = "megatronapp.fbd.run:train"  # `train()` of a parallel.fbd job (forward/backward decoupling)


def _validate_fbd(p: ParallelConfig) -> None:
    """MegaFBD layout pairs that are built (docs/megafbd.md); others are refused naming the field."""
    for name in ("fbd_forward_tp", "fbd_forward_pp", "fbd_forward_instances"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if p.tp % p.fbd_forward_tp:
        raise ConfigError(f"parallel.fbd_forward_tp={p.fbd_forward_tp} must divide parallel.tp={p.tp} (a forward TP "
                          f"shard is a union of backward shards); choose from "
                          f"{[d for d in range(1, p.tp + 1) if p.tp % d == 0]}")
    if p.pp % p.fbd_forward_pp:
        raise ConfigError(f"parallel.fbd_forward_pp={p.fbd_forward_pp} must divide parallel.pp={p.pp} (forward "
                          f"stages are groups of whole backward stages); choose from "
                          f"{[d for d in range(1, p.pp + 1) if p.pp % d == 0]}")
    if p.schedule in ("zb-h1", "dpp"):
        raise ConfigError(f"parallel.schedule={p.schedule!r} does not apply with parallel.fbd: the backward side "
                          f"runs each microbatch's recompute and backward in order; use 1f1b (or interleaved-1f1b "
                          f"with --vpp)")


def _validate_eval(cfg: RunConfig) -> None:
    t = cfg.train
    if t.eval_interval < 0 or t.eval_iters < 1:
        raise ConfigError(f"train.eval_interval={t.eval_interval} must be >= 0 (0: no validation) and "
                          f"train.eval_iters={t.eval_iters} >= 1")
    if t.eval_interval and t.data is not None and t.valid_data is None:
        raise ConfigError(f"train.eval_interval={t.eval_interval} with train.data={t.data!r} needs a held-out "
                          f"file: pass --valid-data PATH (text training never reads)")


def plugin_entries(cfg: RunConfig) -> list[str]:
    """The plug-ins a run attaches, in order: flag-driven modules (tracer first, so injected faults fall inside
    its spans), then `cfg.attach`; each entry once."""
    flagged = [(cfg.trace.enabled, TRACE_PLUGIN), (bool(cfg.inject), INJECT_PLUGIN),
               (cfg.scope_port is not None, SCOPE_PLUGIN)]
    user = [e.strip() if ":" in e else f"{e.strip()}:plugin" for e in cfg.attach]  # "pkg.mod" means pkg.mod:plugin
    return list(dict.fromkeys([entry for on, entry in flagged if on] + user))


def micro_batch_size(cfg: RunConfig) -> int:
    """Samples per microbatch on one DP replica."""
    return cfg.train.global_batch_size // (cfg.parallel.dp * cfg.parallel.microbatches)


PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: small enough to train visibly on 2 CPU cores in a couple of minutes.
    "gpt2-tiny": dict(family="gpt2", vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128),
    "llama-tiny": dict(family="llama", vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                       max_seq_len=128),
    "gpt2-small": dict(family="gpt2", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, max_seq_len=1024),
    "llama-1b": dict(family="llama", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     ffn_hidden_size=5632, max_seq_len=2048),
}


def preset(name: str) -> ModelConfig:
    """A named model shape."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(**PRESETS[name])
