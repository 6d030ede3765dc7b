"""Training metrics: measured peak FLOP/s and MFU, peak memory, a progress line, a JSONL metrics log."""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Self, TextIO

import torch

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype | str = torch.float32,
                       seconds: float = 0.3) -> float:
    """Achievable matmul FLOP/s on `device` in `dtype`: the best rate of square matmuls over ~`seconds`."""
    device, dtype = torch.device(device), _as_dtype(dtype)
    cuda = device.type == "cuda"
    # Big enough to reach the matmul roofline, small enough to time several repeats in the budget.
    n = 4096 if cuda else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    torch.mm(a, b)  # warm-up: kernels selected, caches and clocks up
    sync()
    best, reps, deadline = 0.0, 1, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed > 0:
            best = max(best, 2.0 * n ** 3 * reps / elapsed)
        if time.perf_counter() >= deadline:
            return best
        # Grow the batch of matmuls until one timing lasts ~10 ms, so timer overhead does not count.
        if elapsed < 0.01:
            reps *= 2


def mfu_denominator(peak_tflops: float | None, device: torch.device | str,
                    dtype: torch.dtype | str = torch.float32) -> tuple[float, str, bool]:
    """Per-rank peak FLOP/s for MFU, a description of it for summary.json, and whether it is a vendor peak.

    MFU as the field means it (PaLM, MegaScale) divides by the hardware's advertised peak, given here as
    --peak-tflops. Without it we measure the best square-matmul rate of this device, which is lower than the
    vendor's figure and so flatters MFU: the description and the progress line say which one was used."""
    if peak_tflops:
        return peak_tflops * 1e12, f"vendor peak {peak_tflops:g} TFLOP/s per rank (--peak-tflops)", True
    dt = _as_dtype(dtype)
    rate = measure_peak_flops(device, dt)
    what = (f"measured matmul {rate / 1e12:.3g} TFLOP/s per rank ({str(dt).removeprefix('torch.')} on "
            f"{torch.device(device).type}); not a vendor peak, pass --peak-tflops for one")
    return rate, what, False


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_rank: float, world: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all `world` ranks (0 if peak unknown)."""
    peak = peak_flops_per_rank * world
    if peak <= 0:
        return 0.0
    return tokens_per_s * flops_per_token / peak


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process: allocated tensors on CUDA, max resident set size on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def _fmt_duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """A live one-line bar on a terminal (redrawn with \\r); plain lines every `every` steps otherwise."""

    def __init__(self, total_steps: int, enabled: bool = True, stream: TextIO | None = None,
                 every: int | None = None, width: int = 24, mfu_measured: bool = False):
        self.total = max(1, total_steps)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())
        # About 20 lines for a whole run when the output goes to a log file.
        self.every = every if every is not None else max(1, self.total // 20)
        self.width = width
        # MFU against a measured matmul rate, not a vendor peak: the line says so (it reads higher than MFU)
        self.mfu_tag = " (measured peak)" if mfu_measured else ""
        self.start = time.perf_counter()
        self.base: int | None = None  # steps already done when the bar started (a resumed run)
        self.last_line_len = 0

    def _line(self, done: int, loss: float, tokens_per_s: float, mfu: float, mem_bytes: int, lr: float) -> str:
        if self.base is None:
            self.base = done - 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(1, done - self.base) * max(0, self.total - done)
        stats = (f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%{self.mfu_tag} | "
                 f"mem {_fmt_bytes(mem_bytes)} | {_fmt_duration(elapsed)}<{_fmt_duration(eta)}")
        if self.live:
            filled = int(self.width * min(done, self.total) / self.total)
            bar = "#" * filled + "-" * (self.width - filled)
            return f"[{bar}] {done}/{self.total} {stats}"
        return f"step {done}/{self.total} {stats}"

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float, mem_bytes: int, lr: float) -> None:
        """Show the run after `step` completed optimizer steps (1 after the first, total_steps at the end)."""
        if not self.enabled:
            return
        line = self._line(step, float(loss), float(tokens_per_s), float(mfu), int(mem_bytes), float(lr))
        if self.live:
            pad = " " * max(0, self.last_line_len - len(line))  # wipe the tail of a longer previous line
            self.stream.write("\r" + line + pad)
            self.last_line_len = len(line)
        elif step % self.every == 0 or step <= 1 or step >= self.total:
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()

    def close(self, summary: dict[str, Any]) -> None:
        """End the bar and print `summary` as one short line of key=value pairs."""
        if not self.enabled:
            return
        if self.live and self.last_line_len:
            self.stream.write("\n")
        parts = [f"{k}={_fmt_value(v)}" for k, v in summary.items()]
        self.stream.write("done: " + "  ".join(parts) + "\n")
        self.stream.flush()


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan"/"inf": strict JSON has no such numbers, and a diverged loss must stay visible
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


class MetricsLog:
    """Appends one JSON object per line to `path`, flushed each time so a crashed run loses no step."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        """Write `record` (a step's metrics) as one line."""
        self._f.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        # flush, not fsync: a crashed process loses nothing, and steps pay no disk round-trip.
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics file; a torn last line (crash mid-write) is skipped."""
    records = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
