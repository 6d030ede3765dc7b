"""Where the DP all-reduces run on emulated devices: spans of pp2 x dp2 with DP+PP overlap off and on.

`bench_ablation --emulated` shows what overlap buys; this shows why, from the engine's own spans (the MegaScan
trace: compute spans per task, a comm span per collective from its issue). Each rank records the spans of a few
steps of three trainers: no overlap, DP overlap alone, DP and PP overlap, on the same emulated devices and
modelled wires as the ablation. Per rank and setting it reports: how many DP gradient all-reduces were issued
while a backward task was running (on its device), and the gap from the end of the last backward to the start of
the optimizer step: the DP wire time left exposed, plus the small gradient-norm collectives.

    python -m benchmarks.overlap_trace_emulated          (writes benchmarks/results/overlap_trace_emulated.json)
    python -m benchmarks.overlap_trace_emulated --quick  (one traced step per setting; writes nothing)
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks import ablation_emulated as emu
from benchmarks import harness
from benchmarks.ablation_rows import LAYOUTS, ROWS, build_trainers

RESULTS = harness.results_path("overlap_trace_emulated")
STEPS = 3
NAMES = ("overlap off", "dp overlap only", "overlap on")  # emu.QUICK_ROWS: none, DP alone, DP + PP


class Recorder:
    """A span sink keeping (name, cat, meta, start, end) of every span."""

    def __init__(self) -> None:
        self.spans: list[list[Any]] = []

    def open(self, name: str, cat: str, meta: dict[str, Any]) -> Any:
        rec = [name, cat, {k: meta.get(k) for k in ("group", "bytes")}, time.perf_counter(), None]
        self.spans.append(rec)
        return rec

    def close(self, token: Any) -> None:
        token[4] = time.perf_counter()


def analyse(spans: list[list[Any]]) -> dict[str, Any]:
    """Per step: DP gradient all-reduces issued inside a backward task, and last backward -> optimizer gap."""
    steps, cur = [], []
    for s in spans:
        cur.append(s)
        if s[0] == "optimizer":
            steps.append(cur)
            cur = []
    inside, total, gaps, sends, lengths = 0, 0, [], [], []
    for st in steps:
        # pipeline sends: without PP overlap each is waited where it is issued, so their spans are time the
        # training thread is held (the most PP overlap can give back); with it they run beside the compute
        sends.append(sum(s[4] - s[3] for s in st if s[0] == "send" and s[4] is not None
                         and str(s[2]["group"]).startswith("pp")))
        ends = [s[4] for s in st if s[4] is not None]
        lengths.append(max(ends) - min(s[3] for s in st) if ends else 0.0)
        backs = [(s[3], s[4]) for s in st if s[0] == "backward" and s[4] is not None]
        for s in st:
            if s[0] == "all_reduce" and s[2]["group"] == "dp" and (s[2]["bytes"] or 0) > 64:
                total += 1
                inside += any(a <= s[3] <= b for a, b in backs)
        opt = next(s for s in st if s[0] == "optimizer")
        if backs:
            gaps.append(opt[3] - max(b for _, b in backs))
    return {"steps": len(steps), "dp_grad_all_reduces": total, "issued_during_backward": inside,
            "median_backward_end_to_optimizer_s": statistics.median(gaps) if gaps else None,
            "median_pp_send_span_s": statistics.median(sends) if sends else None,
            "median_step_span_s": statistics.median(lengths) if lengths else None}


def worker(rank: int, world: int, configs: list[dict[str, Any]], steps: int, outdir: str) -> None:
    from megatronapp import tracing
    from megatronapp.parallel.link_model import LinkModel

    trainers = build_trainers(configs, world, rank)
    wire = LinkModel(emu.LINKS_GBPS).install()
    out = {}
    try:
        for name, tr in zip(NAMES, trainers):
            emu.emulated_step(tr)  # warm-up, untraced
            rec = Recorder()
            tracing.install(rec)
            for _ in range(steps):
                emu.emulated_step(tr)
            tracing.uninstall(rec)
            out[name] = analyse(rec.spans)
    finally:
        wire.remove()
        for tr in trainers:
            tr.close()
    harness.report(outdir, rank, out)


def main(argv: list[str] | None = None) -> None:
    args = harness.parser(__doc__, "one traced step per setting; writes nothing").parse_args(argv)
    steps = 1 if args.quick else STEPS
    clock = harness.Clock()
    pairs = emu.emulated_configs(emu.emulated_rows(ROWS), LAYOUTS["pp=2 x dp=2"], dict(emu.EMU_QUICK), emu.SPEC)
    configs = [c for r, c in pairs if r[0] in emu.QUICK_ROWS]
    ranks = dict(enumerate(harness.launch(worker, 4, configs, steps)))
    result = {"layout": "pp=2 x dp=2", "spec": emu.SPEC, "links_gbps": emu.LINKS_GBPS, "steps": steps,
              "ranks": ranks, "timestamp": clock.timestamp,
              "machine": harness.machine(clock, emulated=True, ranks=4, threads_per_rank=1, backend="gloo")}
    for r, v in ranks.items():
        for name, a in v.items():
            print(f"rank {r} {name}: {a['issued_during_backward']}/{a['dp_grad_all_reduces']} DP grad all-reduces "
                  f"issued during a backward; last backward end -> optimizer "
                  f"{1e3 * a['median_backward_end_to_optimizer_s']:.0f} ms; PP send spans "
                  f"{1e3 * a['median_pp_send_span_s']:.0f} ms of a {1e3 * a['median_step_span_s']:.0f} ms step "
                  f"(median of {a['steps']} steps)")
    print(f"load {tuple(result['machine']['load_avg_at_end'])}")
    if not args.quick:
        harness.write_result(result, RESULTS)
        print(f"wrote {harness.shown(RESULTS)}")


if __name__ == "__main__":
    main()
