"""Host-side compression of captured tensors, chosen from a fixed menu (never code from a message).

A `Compression` says, per capture point, how to shrink a tensor before it is sent to a browser:
  1. pooling (`mean`, `max`, `absmax`) into `buckets` buckets along one axis. Bucket i covers the half-open
     range [floor(i*n/N), floor((i+1)*n/N)), so bucket sizes differ by at most one and the remainder is spread
     over all buckets instead of piling into (or being cut from) the last one;
  2. optional top-k by magnitude (values and flat indices);
  3. quantization: `fp32`, `fp16`, or symmetric `int8` with one scale (value = q * scale).
The result is a JSON-ready dict whose `data` is base64 of little-endian bytes, decoded by the page.
"""
from __future__ import annotations

import base64
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class Compression(BaseModel):
    """How one capture point is shrunk before it leaves the host."""

    model_config = ConfigDict(extra="forbid")

    pool: Literal["none", "mean", "max", "absmax"] = "none"
    buckets: int = Field(64, ge=1, le=4096)
    axis: int = Field(-1, ge=-8, le=7)
    topk: int | None = Field(None, ge=1, le=4096)
    quant: Literal["fp32", "fp16", "int8"] = "fp16"


def bucket_bounds(n: int, buckets: int) -> torch.Tensor:
    """Start offsets of `buckets` near-equal buckets over n items, plus n at the end (length buckets+1)."""
    buckets = min(buckets, n)
    return torch.div(torch.arange(buckets + 1) * n, buckets, rounding_mode="floor")


def pool(x: torch.Tensor, kind: str, buckets: int, axis: int = -1) -> torch.Tensor:
    """Pool `x` into at most `buckets` buckets along `axis` (mean, max, or signed value of largest magnitude)."""
    if kind == "none":
        return x
    axis = axis % x.dim()
    n = x.shape[axis]
    if n <= buckets or n == 0:
        return x
    bounds = bucket_bounds(n, buckets)
    # index of the bucket of each position along the axis
    owner = torch.bucketize(torch.arange(n), bounds[1:], right=True)
    moved = x.movedim(axis, -1).float()
    idx = owner.expand_as(moved)
    out_shape = (*moved.shape[:-1], buckets)
    if kind == "mean":
        out = torch.zeros(out_shape).scatter_reduce_(-1, idx, moved, "sum")
        out = out / (bounds[1:] - bounds[:-1]).float()
    elif kind == "max":
        out = torch.full(out_shape, float("-inf")).scatter_reduce_(-1, idx, moved, "amax", include_self=False)
    elif kind == "absmax":
        mag = torch.zeros(out_shape).scatter_reduce_(-1, idx, moved.abs(), "amax", include_self=False)
        # keep the sign of the element that attains the magnitude (positive wins ties)
        is_pos_max = (moved == mag.gather(-1, idx)).float()
        hit_pos = torch.zeros(out_shape).scatter_reduce_(-1, idx, is_pos_max, "amax", include_self=False)
        out = torch.where(hit_pos > 0, mag, -mag)
    else:
        raise ValueError(f"pool={kind!r}: choose none, mean, max or absmax")
    return out.movedim(-1, axis)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Symmetric int8: q = round(x / scale) with scale = max|x| / 127 (scale 1 for an all-zero tensor)."""
    x = x.float()
    finite = x[torch.isfinite(x)]
    amax = float(finite.abs().max()) if finite.numel() else 0.0
    scale = amax / 127.0 if amax > 0 else 1.0
    q = torch.clamp(torch.round(torch.nan_to_num(x, nan=0.0) / scale), -127, 127).to(torch.int8)
    return q, scale


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def encode(x: torch.Tensor, quant: str = "fp16") -> dict[str, Any]:
    """A tensor as {dtype, shape, data(base64)[, scale]} in the chosen storage."""
    x = x.detach().cpu()
    shape = list(x.shape)
    if quant == "int8":
        q, scale = quantize_int8(x)
        return {"dtype": "int8", "shape": shape, "scale": scale, "data": _b64(q)}
    if quant == "fp16":
        # clamp so values beyond fp16 range show as the largest finite value instead of infinity
        return {"dtype": "fp16", "shape": shape, "data": _b64(x.float().clamp(-65504, 65504).half())}
    if quant == "fp32":
        return {"dtype": "fp32", "shape": shape, "data": _b64(x.float())}
    raise ValueError(f"quant={quant!r}: choose fp32, fp16 or int8")


def decode(msg: dict[str, Any]) -> torch.Tensor:
    """Inverse of `encode` (tests and Python clients); int8 comes back multiplied by its scale."""
    raw = bytearray(base64.b64decode(msg["data"]))
    dtype = {"int8": torch.int8, "fp16": torch.float16, "fp32": torch.float32}[msg["dtype"]]
    t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    t = t.reshape(msg["shape"]).float()
    return t * msg["scale"] if msg["dtype"] == "int8" else t


def compress(x: torch.Tensor, spec: Compression) -> dict[str, Any]:
    """Pool, then top-k, then quantize `x` as `spec` says; the result records what was done."""
    x = x.detach().float().cpu()
    out: dict[str, Any] = {"orig_shape": list(x.shape)}
    if spec.pool != "none" and x.dim() > 0:
        x = pool(x, spec.pool, spec.buckets, spec.axis)
        out["pool"] = {"kind": spec.pool, "axis": spec.axis % max(1, x.dim()), "buckets": spec.buckets}
    if spec.topk is not None and x.numel() > spec.topk:
        flat = x.reshape(-1)
        idx = flat.abs().topk(spec.topk).indices.sort().values
        out["topk"] = {"indices": idx.tolist(), "shape": list(x.shape)}
        x = flat[idx]
    out.update(encode(x, spec.quant))
    return out
