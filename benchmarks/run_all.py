"""`make bench`: run every benchmark in its own process, one after another (they measure ratios in one run,
so they must not overlap on a small machine). Results go to benchmarks/results/*.json and docs/benchmarks.md."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    names = sorted(p.stem for p in HERE.glob("bench_*.py"))
    only = sys.argv[1:]
    failed = []
    for name in names:
        if only and not any(o in name for o in only):
            continue
        print(f"\n### {name}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"], cwd=HERE.parent)
        print(f"### {name}: exit {code} in {time.perf_counter() - t0:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
