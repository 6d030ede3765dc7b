"""Perturbations from a typed spec: noise, offsets, zeroing and IEEE-754 bit flips at chosen places.

Places (the three levels at which faults are studied):
  weight      storage faults: parameters are changed in place and restored bit-exactly on `detach()`;
  activation  calculation faults: a capture point's value is replaced downstream (`layers.L.attn.q`, ...);
  hidden      system faults: the hidden state passed between layers (`layers.L.out`).
Kinds: additive Gaussian (std = strength), multiplicative uniform (x * (1 + U(-strength, strength))), constant
offset (x + strength), zeroing, and bit flips (a chosen bit, or a random bit per element) of the float32, bf16 or
fp16 representation. Elements are all of them, a random fraction (`rate`), or chosen flat `indices`, optionally
restricted to some attention heads (dim 1 of q/k/v/probs; k/v count kv heads).

Reproducibility: every random draw comes from a generator seeded by (seed, point name, call number), so the same
spec on the same inputs perturbs the same elements in the same way. `reset()` restarts the call numbers.

Gradients (when used in training): noise and offsets are added, so the gradient passes unchanged; the
multiplicative kind scales the gradient by the same factor; zeroing blocks the gradient of the zeroed elements;
a bit flip passes the gradient through unchanged (straight-through), since a flip has no derivative.
Weight perturbations change the stored value the optimizer would update: restore them before an optimizer step.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Literal, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megatronapp.config import ModelConfig
from megatronapp.model.capture import Capture, HookHandle
from megatronapp.parallel import comm
from megatronapp.parallel.tensor_parallel import tp_rank

ACTIVATION_POINTS = ("in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out", "mlp.out", "out")
HEAD_POINTS = ("attn.q", "attn.k", "attn.v", "attn.probs")
# weights whose rows (qkv: the query rows of a head) or columns (proj: a head's input) belong to one head
HEAD_WEIGHTS = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight")
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Perturbation(BaseModel):
    """One perturbation: what to do (kind), where (place, target, layers, heads), to which elements, seed."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["gaussian", "uniform", "offset", "zero", "bitflip"]
    place: Literal["weight", "activation", "hidden"] = "activation"
    # activation: a point of ACTIVATION_POINTS; weight: a parameter name inside a layer ("attn.qkv.weight")
    # or a full parameter name; hidden: ignored (always layers.L.out)
    target: str = Field("out", max_length=64, pattern=r"^[A-Za-z0-9_.]+$")
    layers: list[int] | None = Field(None, max_length=1024)
    heads: list[int] | None = Field(None, max_length=1024)
    strength: float = Field(0.0, allow_inf_nan=False, ge=-1e6, le=1e6)
    rate: float | None = Field(None, ge=0.0, le=1.0)
    indices: list[int] | None = Field(None, max_length=4096)
    bit: int | None = Field(None, ge=0, le=31)
    storage: Literal["native", "fp32", "bf16", "fp16"] = "native"
    seed: int = Field(0, ge=0, le=2**62)
    enabled: bool = True

    @model_validator(mode="after")
    def _check(self) -> Perturbation:
        if self.kind == "bitflip" and self.rate is None and self.indices is None:
            raise ValueError("a bitflip needs `rate` (fraction of elements) or `indices` (flat element indices)")
        if self.rate is not None and self.indices is not None:
            raise ValueError("give either `rate` or `indices`, not both")
        if self.indices is not None and any(i < 0 for i in self.indices):
            raise ValueError("`indices` must be >= 0")
        if self.place == "activation" and self.target not in ACTIVATION_POINTS:
            raise ValueError(f"target={self.target!r} is not an activation point; choose one of "
                             f"{', '.join(ACTIVATION_POINTS)}")
        if self.heads is not None and self.place == "activation" and self.target not in HEAD_POINTS:
            raise ValueError(f"`heads` applies to {', '.join(HEAD_POINTS)}, not to {self.target!r}")
        if self.heads is not None and self.place == "weight" and self.target not in HEAD_WEIGHTS:
            raise ValueError(f"`heads` on weights applies to {', '.join(HEAD_WEIGHTS)}, not to {self.target!r}")
        if self.heads is not None and self.place == "hidden":
            raise ValueError("`heads` does not apply to the hidden state; use place=activation with attn.q/k/v/probs")
        if self.layers is not None and any(L < 0 for L in self.layers):
            raise ValueError("`layers` must be >= 0")
        bits = 32 if self.storage in ("native", "fp32") else 16
        if self.bit is not None and self.bit >= bits:
            raise ValueError(f"bit={self.bit} is outside a {bits}-bit {self.storage} value (0..{bits - 1})")
        return self

    def point(self, layer: int) -> str:
        """Capture-point name this spec acts on at `layer` (activation and hidden places)."""
        return f"layers.{layer}.out" if self.place == "hidden" else f"layers.{layer}.{self.target}"


def load_perturbations(path: str | Path) -> list[Perturbation]:
    """Read a YAML file holding a list of perturbations (or a mapping with key `perturbations`)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"perturbation file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"perturbation file {p} is not valid YAML: {e}") from None
    if isinstance(data, dict):
        data = data.get("perturbations")
    items: list | None = data if isinstance(data, list) else None
    if items is None:
        raise ValueError(f"perturbation file {p} must hold a list of perturbations (or key `perturbations:`)")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(Perturbation.model_validate(item))
        except ValidationError as e:
            raise ValueError(f"perturbation file {p}, item {i}: {e}") from None
    return out


def generator_for(seed: int, name: str, call: int) -> torch.Generator:
    """A CPU generator seeded from (seed, name, call) with a stable hash (not Python's salted hash())."""
    mixed = zlib.crc32(f"{name}#{call}".encode()) ^ (seed * 0x9E3779B1)
    return torch.Generator().manual_seed(mixed & (2**63 - 1))


class _StraightThrough(torch.autograd.Function):
    """Forward returns `new` bit-exactly; backward passes the gradient to `x` unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return new.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def flip_bits(x: torch.Tensor, bits: torch.Tensor | int, mask: torch.Tensor | None) -> torch.Tensor:
    """XOR bit `bits` (an int or a per-element tensor) of the IEEE-754 pattern of `x` where `mask` holds."""
    if x.dtype not in _INT_VIEW:
        raise TypeError(f"bit flips need float32, bf16 or fp16 storage, got {x.dtype}")
    ints = x.detach().contiguous().view(_INT_VIEW[x.dtype])
    if not torch.is_tensor(bits):
        bits = torch.full_like(ints, int(bits))
    pattern = torch.bitwise_left_shift(torch.ones_like(ints), bits.to(ints.dtype))
    if mask is not None:
        pattern = torch.where(mask, pattern, torch.zeros_like(pattern))
    return torch.bitwise_xor(ints, pattern).view(x.dtype)


def select(spec: Perturbation, shape: torch.Size, gen: torch.Generator, head_dim: int | None,
           head_offset: int = 0) -> torch.Tensor | None:
    """Boolean mask of the elements `spec` touches (None: all of them)."""
    mask = None
    numel = 1
    for d in shape:
        numel *= d
    if spec.indices is not None:
        bad = [i for i in spec.indices if i >= numel]
        if bad:
            raise ValueError(f"indices {bad[:5]} are outside a tensor of {numel} elements (shape {list(shape)})")
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[torch.tensor(spec.indices, dtype=torch.long)] = True
        mask = mask.reshape(shape)
    elif spec.rate is not None:
        mask = torch.rand(shape, generator=gen) < spec.rate
    if spec.heads is not None and head_dim is not None:
        local = [h - head_offset for h in spec.heads if 0 <= h - head_offset < shape[head_dim]]
        hm = torch.zeros(shape[head_dim], dtype=torch.bool)
        if local:
            hm[torch.tensor(local)] = True
        view = [1] * len(shape)
        view[head_dim] = shape[head_dim]
        hm = hm.reshape(view).expand(shape)
        mask = hm if mask is None else mask & hm
    return mask


def apply(x: torch.Tensor, spec: Perturbation, gen: torch.Generator, head_dim: int | None = None,
          head_offset: int = 0) -> torch.Tensor:
    """A perturbed copy of `x` (autograd-friendly, see the module doc); `x` itself is not modified."""
    if not spec.enabled:
        return x
    # zero strength returns x itself: adding +0.0 would already turn -0.0 into +0.0
    if spec.kind in ("gaussian", "uniform", "offset") and spec.strength == 0.0:
        return x
    mask = select(spec, x.shape, gen, head_dim, head_offset)
    if mask is not None:
        mask = mask.to(x.device)
    if spec.kind == "gaussian":
        noise = (torch.randn(x.shape, generator=gen) * spec.strength).to(x.device, x.dtype)
        return x + (noise if mask is None else noise * mask)
    if spec.kind == "uniform":
        u = (torch.rand(x.shape, generator=gen) * 2 - 1) * spec.strength
        factor = (1 + u).to(x.device, x.dtype)
        if mask is not None:
            factor = torch.where(mask, factor, torch.ones_like(factor))
        return x * factor
    if spec.kind == "offset":
        return x + (spec.strength if mask is None else mask.to(x.dtype) * spec.strength)
    if spec.kind == "zero":
        return x.masked_fill(torch.ones((), dtype=torch.bool, device=x.device) if mask is None else mask, 0.0)
    # bitflip
    storage = x.dtype if spec.storage == "native" else _STORAGE[spec.storage]
    if storage not in _INT_VIEW:
        raise TypeError(f"bit flips need float32, bf16 or fp16 values; this tensor is {x.dtype} "
                        f"(set storage to fp32, bf16 or fp16 to flip bits of that representation)")
    nbits = 8 * torch.tensor([], dtype=storage).element_size()
    if spec.bit is not None and spec.bit >= nbits:
        raise ValueError(f"bit={spec.bit} is outside a {nbits}-bit {storage} value")
    bits: torch.Tensor | int = spec.bit if spec.bit is not None else torch.randint(0, nbits, x.shape, generator=gen)
    if torch.is_tensor(bits):
        bits = bits.to(x.device)
    stored = x.detach().to(storage)
    flipped = flip_bits(stored, bits, mask).to(x.dtype)
    if mask is not None and storage != x.dtype:
        flipped = torch.where(mask, flipped, x.detach())  # untouched elements keep their exact value
    return _StraightThrough.apply(x, flipped)


class Perturber:
    """Attaches a list of perturbations to one model: capture hooks for activations, in-place edits for weights.

    Under tensor parallelism (`tp_group` of more than one rank) a perturbation of a sharded value (a sharded
    weight, or q/k/v/probs) is applied to the full tensor, gathered from every TP rank, and each rank keeps its own
    slice: random draws, flat `indices` and `heads` then mean what they mean in one process (a bit flip on global
    index i lands on the rank that owns element i), and the results equal the one-process run. On a pipeline stage
    (a chunk holding some layers), perturbations of other stages' layers are left to those stages."""

    def __init__(self, specs: list[Perturbation], model: torch.nn.Module, capture: Capture,
                 cfg: ModelConfig, tp_group: Any = None):
        self.specs = [s for s in specs if s.enabled]
        self.model, self.capture, self.num_layers = model, capture, cfg.num_layers
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.local_heads, self.local_kv = cfg.num_heads, int(cfg.num_kv_heads)  # masks act on full tensors
        self.head_dim = cfg.head_dim
        self._handles: list[HookHandle] = []
        self._saved: dict[str, torch.Tensor] = {}
        self._calls: dict[str, int] = {}

    def _layers(self, spec: Perturbation) -> list[int]:
        layers = list(range(self.num_layers)) if spec.layers is None else spec.layers
        bad = [L for L in layers if L >= self.num_layers]
        if bad:
            raise ValueError(f"layers {bad} do not exist; the model has layers 0..{self.num_layers - 1}")
        return layers

    def reset(self) -> None:
        """Restart call numbers so the next run draws the same random numbers as the first."""
        self._calls.clear()

    def attach(self) -> Perturber:
        """Register activation hooks and apply weight perturbations (originals saved)."""
        try:
            for spec in self.specs:
                if spec.place == "weight":
                    self._apply_weights(spec)
                else:
                    for layer in self._layers(spec):
                        self._handles.append(self.capture.add(spec.point(layer), self._hook(spec)))
        except Exception:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Remove hooks and restore every perturbed weight bit-exactly."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, orig in self._saved.items():
                params[name].copy_(orig)
        self._saved.clear()

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _hook(self, spec: Perturbation):
        def hook(name: str, x: torch.Tensor, info: dict) -> torch.Tensor:
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            head_dim = 1 if spec.place == "activation" and spec.target in HEAD_POINTS else None
            gen = generator_for(spec.seed, name, call)
            tp_dim = info.get("tp_dim")
            if self.tp_group is None or tp_dim is None:
                return apply(x, spec, gen, head_dim)
            # every TP rank reaches this point together: perturb the full tensor, keep this rank's slice
            full = comm.all_gather(x.detach(), self.tp_group, dim=tp_dim)
            new = apply(full, spec, gen, head_dim)
            mine = new.chunk(self.tp_group.size, dim=tp_dim)[tp_rank(self.tp_group)]
            return _StraightThrough.apply(x, mine.contiguous())
        return hook

    def _weight_names(self, spec: Perturbation) -> list[str]:
        params = dict(self.model.named_parameters())
        if spec.target in params and spec.layers is None:
            return [spec.target]
        here = getattr(self.model, "layer_indices", None)  # a pipeline stage holds some layers only
        layers = [L for L in self._layers(spec) if here is None or L in here]
        names = [f"layers.{L}.{spec.target}" for L in layers]
        missing = [n for n in names if n not in params]
        if missing:
            inside = sorted({n.split(".", 2)[2] for n in params if n.startswith("layers.")})
            outside = [n for n in params if not n.startswith("layers.")]
            raise ValueError(f"weight target {spec.target!r} not found ({missing[0]}); parameters inside a layer: "
                             f"{', '.join(inside)}; outside: {', '.join(outside)}")
        return names

    def _apply_weights(self, spec: Perturbation) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self._weight_names(spec):
                p = params[name]
                if name not in self._saved:
                    self._saved[name] = p.detach().clone()
                full, sharded = self._full(p)
                new = apply(full, spec.model_copy(update={"heads": None}), generator_for(spec.seed, name, 0))
                if spec.heads is not None:
                    new = torch.where(self._weight_head_mask(spec, full.shape).to(p.device), new, full)
                p.copy_(self._own(new, p) if sharded else new)

    def _full(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, bool]:
        """The whole weight as one process holds it (gathered over TP; vocabulary padding rows dropped)."""
        if self.tp_group is None or not getattr(p, "tensor_parallel", False):
            return p.detach(), False
        full = comm.all_gather(p.detach(), self.tp_group, dim=p.partition_dim)
        vocab = getattr(p, "vocab_size", None)
        return (full[:vocab] if vocab is not None else full), True

    def _own(self, full: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's slice of a perturbed full weight (padding rows, which are not the model's, kept as they are)."""
        local = p.shape[p.partition_dim]
        start = tp_rank(self.tp_group) * local
        part = full.narrow(p.partition_dim, start, max(0, min(local, full.shape[p.partition_dim] - start)))
        if part.shape[p.partition_dim] == local:
            return part
        keep = p.detach().narrow(p.partition_dim, part.shape[p.partition_dim], local - part.shape[p.partition_dim])
        return torch.cat([part, keep], dim=p.partition_dim)

    def _weight_head_mask(self, spec: Perturbation, shape: torch.Size) -> torch.Tensor:
        """Elements of a qkv/proj weight that belong to the chosen (global) query heads."""
        d, g = self.head_dim, self.local_heads // self.local_kv
        local = [h for h in spec.heads or [] if 0 <= h < self.local_heads]
        mask = torch.zeros(shape, dtype=torch.bool)
        for h in local:
            if spec.target == "attn.proj.weight":  # input columns of head h
                mask[:, h * d:(h + 1) * d] = True
            else:  # query rows of head h inside its kv group (layout: g query heads, k head, v head)
                row = ((h // g) * (g + 2) + h % g) * d
                mask[row:row + d] = True
        return mask

