"""MegaScan: low-overhead tracing, merged timelines with aligned clocks, slow rank and link detection.

`instrument`, `step` and `uninstrument` trace any PyTorch job (scan/record/instrument.py); they are imported on
first use so `import megatronapp.scan` stays cheap.
"""
from __future__ import annotations

from typing import Any

__all__ = ["instrument", "step", "trace_ddp", "uninstrument"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        mod = importlib.import_module("megatronapp.scan.record.instrument")
        globals().update({n: getattr(mod, n) for n in __all__})
        return globals()[name]
    raise AttributeError(f"module 'megatronapp.scan' has no attribute {name!r}")
