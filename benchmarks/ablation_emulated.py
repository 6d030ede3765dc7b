"""MegaScale's ablation rows on emulated devices with modelled wires (`bench_ablation --emulate-device SPEC`).

On 4 CPU ranks sharing 2 cores, communication and compute fight for the same cores, so overlap can hide only
waiting. Here every rank has an emulated accelerator (`parallel/device_emulation.py`: each task computes its
real tensors, then sleeps out its modelled device time, so the host core is free) and every collective and
P2P send takes its bytes over a modelled link (`parallel/link_model.py`): a fast link inside a TP group
(NVLink-class) and a slower one across DP and PP (network-class). The link speeds are not a real machine's
GB/s: our tiny model does ~10^3 FLOPs per gradient byte where a large run does ~10^5, so they are set for a
realistic *share* of communication in the step (the DP all-reduce of a stage's gradients about a quarter of
its compute, a TP link 12x faster than the DP/PP link, as NVLink to 400G InfiniBand).

What the emulation can judge, and what not:
  * DP overlap, PP overlap: yes, that is hiding wire time behind device time, which is what is modelled.
    Optimistic bound: a task's real compute runs at its start and the device time is slept after it, so all
    DP buckets of a backward are issued early in it; on a GPU the last bucket is issued at the end of the
    backward and its all-reduce stays exposed.
  * TP overlap: no. The TP collectives run inside a task's host compute, which counts against its device time,
    so with or without chunking they hide behind the device's sleep; on a GPU they serialise with the GEMMs.
  * data pipeline: yes in principle (batch building is host work the device does not wait for when prefetched),
    but our embedded corpus builds a batch in well under a millisecond, so it is ~1.0 by construction.
  * parallel block + sliding window, LAMB's speed: no. Device time is FLOPs over a rate: a fused GEMM or a
    kernel that skips masked blocks is not faster in that model (MFU counts the same FLOPs); the parallel
    block's gain is GEMM fusion and fewer launches, a kernel property. LAMB at 4x batch: the bubble and the
    per-step overheads (optimizer, DP all-reduce) amortised over 4x tokens, which the model does judge.
  * ZeRO-1: its memory (optimizer state per rank), measured exactly; its speed cost is the parameter
    all-gather on the DP link, which is modelled.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from benchmarks import harness, stats
from benchmarks.ablation_rows import LAYOUTS, ROWS, build_trainers, rotated_steps, row_configs, row_records

RESULTS = harness.results_path("ablation_emulated")
SECTION = "## Ablation on emulated devices: MegaScale's techniques where the step runs on the device"
# A device slow enough that the host compute of a task stays a small share of its device time on this loaded
# 2-core machine (the run reports that share per row; a share above 0.5 leaves the accelerator regime).
SPEC = "tflops=0.001"
LINKS_GBPS = {"tp": 0.06, "dp": 0.005, "pp": 0.005, "embd": 0.005}
# tp2 x dp2 does about twice pp2 x dp2's host work per device second (every rank runs every layer's Python and
# its TP collectives on gloo inside the task's host compute): at the same rate it left the accelerator regime
# (host share 0.75-0.98 at load 1-50), at half the rate it sat at the limit (0.42-0.57 at load 31-45), so its
# device and links run this many times slower: the same ratio of wire to device time, a quarter of the host share.
SLOWER = {"tp=2 x dp=2": 4.0}


def slowed(spec: str, links: dict[str, float], factor: float) -> tuple[str, dict[str, float]]:
    """`spec` with its device rate, and `links` with their speeds, divided by `factor`."""
    parts = [f"tflops={float(p.split('=', 1)[1]) / factor:g}" if p.startswith("tflops=") else p
             for p in spec.split(",")]
    return ",".join(parts), {k: v / factor for k, v in links.items()}
EMU_FULL = {"hidden": 128, "layers": 4, "heads": 4, "seq": 64, "global_batch": 16, "microbatches": 4,
            "warmup": 2, "reps": 12, "bucket_mb": 0.25}
EMU_QUICK = {"hidden": 128, "layers": 4, "heads": 4, "seq": 64, "global_batch": 16, "microbatches": 4,
             "warmup": 1, "reps": 12, "bucket_mb": 0.25}
HOST_SHARE_LIMIT = 0.5  # device_emulation's default host_share: above it a run is not in the accelerator regime
NO_OVERLAP = "+ parallel block + sliding window"  # the last row without any communication overlap
OVERLAP_ROWS = ("+ DP overlap", "+ PP overlap", "+ TP overlap")
QUICK_ROWS = (NO_OVERLAP, "+ DP overlap", "+ PP overlap")  # pp2 x dp2: none, DP alone, DP + PP


def emulated_rows(cpu_rows: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """The CPU-bound rows with "+ communication overlap" split into DP, PP and TP overlap, each its own row (so
    each has its own paired ratio); a row that changes nothing on a layout (PP overlap on tp2 x dp2) is dropped
    there by `emulated_configs`."""
    out = []
    for name, gain, add in cpu_rows:
        if name != "+ communication overlap":
            out.append((name, gain, add))
            continue
        out += [("+ DP overlap", f"{gain} (DP, PP, TP together)", {"parallel": {"dp_overlap": True}}),
                ("+ PP overlap", "(in the above)", {"parallel": {"pp_overlap": "if-pp"}}),
                ("+ TP overlap", "(in the above)", {"parallel": {"tp_comm_overlap": "if-sp"}})]
    return out


def emulated_step(trainer) -> float:
    """One fenced step of `trainer` on its emulated device (train_step puts its own device in charge, the
    optimizer step included: parallel/emulation.py): its wall seconds."""
    return harness.fenced(trainer.train_step)[0]


def _host_share(trainer) -> tuple[float, float]:
    """(host s, device s) of this rank's tasks in the steps after its first."""
    rows = trainer.emulation.record()
    return sum(r[1] for r in rows), sum(r[3] for r in rows)


def worker(rank: int, world: int, configs: list[dict[str, Any]], links: dict[str, float], warmup: int, reps: int,
           outdir: str) -> None:
    """Spawned entry: every row's trainer in these 4 processes, the link model hooked once, rotated steps."""
    import torch.distributed as dist

    from megatronapp.parallel.distributed_optimizer import optimizer_state_bytes
    from megatronapp.parallel.link_model import LinkModel

    trainers = build_trainers(configs, world, rank)
    wire = LinkModel(links).install()
    try:
        times = rotated_steps(trainers, warmup, reps)
        per_row = []
        for tr in trainers:
            host, device = _host_share(tr)
            t = torch.tensor([host / device if device else 0.0, float(optimizer_state_bytes(tr.optimizer))],
                             dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the worst rank's host share, the largest state
            per_row.append(t.tolist())
    finally:
        wire.remove()
        for tr in trainers:
            tr.close()
    if rank == 0:
        harness.report(outdir, rank, {"times": times, "host_share": [r[0] for r in per_row],
                                      "optimizer_state_bytes": [int(r[1]) for r in per_row],
                                      "wire_busy_s_rank0": wire.busy_s})


def emulated_configs(rows: list[tuple[str, str, dict]], layout: dict[str, Any], size: dict[str, Any],
                     spec: str) -> list[tuple[tuple[str, str, dict], dict]]:
    """(row, run config) of every row of `rows` that changes something on this layout, on emulated devices."""
    out: list[tuple[tuple[str, str, dict], dict]] = []
    for row, c in zip(rows, row_configs(layout, size, rows)):
        c["emulate_device"] = spec
        c["parallel"]["grad_bucket_mb"] = size["bucket_mb"]
        if out and c == out[-1][1]:
            continue  # e.g. PP overlap with pp=1: the same run as the row above, nothing to measure
        out.append((row, c))
    return out


def summarise(pairs: list[tuple[tuple[str, str, dict], dict]], layout: str, rec: dict, spec: str,
              world: int) -> dict[str, Any]:
    from megatronapp.parallel.device_emulation import parse_spec

    peak = parse_spec(spec).rate * world
    out = row_records([r for r, _ in pairs], [c for _, c in pairs], rec["times"], peak,
                      host_share=rec["host_share"], optimizer_state_bytes=rec["optimizer_state_bytes"])
    names = [r["row"] for r in out]
    overlap = [i for i, n in enumerate(names) if n in OVERLAP_ROWS]
    if NO_OVERLAP in names and overlap:  # every overlap of this layout together over none, paired per repetition
        base, last = names.index(NO_OVERLAP), overlap[-1]
        ratios = stats.paired_ratios([out[last]["tokens_per_step"] / t for t in rec["times"][last]],
                                     [out[base]["tokens_per_step"] / t for t in rec["times"][base]])
        out[last]["vs_no_overlap"] = stats.summarize_ratios(ratios, lower_is_better=False)
    return {"layout": layout, "emulated_peak_flops": peak, "rows": out,
            "wire_busy_s_rank0": rec.get("wire_busy_s_rank0", {})}


def run(spec: str, quick: bool, reps: int | None = None, only_layout: str | None = None) -> dict[str, Any]:
    size = dict(EMU_QUICK if quick else EMU_FULL)
    if reps is not None:
        size["reps"] = reps
    chosen = {"pp=2 x dp=2": LAYOUTS["pp=2 x dp=2"]} if quick else LAYOUTS
    if only_layout is not None:
        chosen = {k: v for k, v in LAYOUTS.items() if k.startswith(only_layout)}
    clock = harness.Clock()
    out = []
    for name, layout in chosen.items():
        lay_spec, links = slowed(spec, LINKS_GBPS, SLOWER.get(name, 1.0))
        pairs = emulated_configs(emulated_rows(ROWS), layout, size, lay_spec)
        if quick:
            pairs = [(r, c) for r, c in pairs if r[0] in QUICK_ROWS]
        lay_clock = harness.Clock()
        (rec,) = harness.launch(worker, 4, [c for _, c in pairs], links, size["warmup"], size["reps"])
        out.append(summarise(pairs, name, rec, lay_spec, 4))
        out[-1].update(spec=lay_spec, links_gbps=links, slower=SLOWER.get(name, 1.0),
                       recorded=lay_clock.timestamp, load_avg_at_start=lay_clock.load,
                       load_avg_at_end=os.getloadavg())
    worst = max(r["host_share"] for lay in out for r in lay["rows"])
    return {"benchmark": "ablation of MegaScale's techniques on emulated devices with modelled wires",
            "timestamp": clock.timestamp, "wall_s": clock.wall_s(), "spec": spec, "links_gbps": LINKS_GBPS,
            "size": size, "machine": harness.machine(clock, emulated=True, host_share=worst, ranks=4,
                                                     threads_per_rank=1, backend="gloo"), "layouts": out}


def quick_line(result: dict[str, Any]) -> dict[str, Any]:
    """The quick mode's JSON: tokens/s with DP+PP overlap over without, pp2 x dp2, with its interval; then DP
    overlap alone over none and PP overlap over DP alone."""
    rows = {r["row"]: r for r in result["layouts"][0]["rows"]}
    both, dp, pp = rows["+ PP overlap"]["vs_no_overlap"], rows["+ DP overlap"]["vs_previous"], \
        rows["+ PP overlap"]["vs_previous"]

    def r4(v: dict[str, Any]) -> list[Any]:
        return [round(v["ratio"], 4), [round(x, 4) for x in v["ci95"]]]

    return {"overlap_ratio": r4(both)[0], "overlap_ci": r4(both)[1], "dp_overlap": r4(dp), "pp_overlap": r4(pp),
            "host_share_max": round(max(r["host_share"] for r in rows.values()), 3)}


JUDGED = {"baseline": "-", "+ parallel block + sliding window": "no (kernel property)",
          "+ DP overlap": "yes (optimistic bound)", "+ PP overlap": "yes",
          "+ TP overlap": "no (host compute)", "+ communication overlap": "DP, PP: yes; TP: no",
          "+ data pipeline": "yes (~1.0 by construction)",
          "+ LAMB, 4x batch": "amortisation only", "+ ZeRO-1 (memory)": "memory: yes"}


def table(result: dict[str, Any]) -> str:
    lines = []
    for lay in result["layouts"]:
        busy = ", ".join(f"{k} {v:.2f} s" for k, v in lay["wire_busy_s_rank0"].items())
        lines += [f"**{lay['layout']}**, emulated (`{lay.get('spec', result['spec'])}` per rank; links "
                  + ", ".join(f"{k} {v:g} GB/s" for k, v in lay.get("links_gbps", result["links_gbps"]).items())
                  + f"; rank 0's modelled wire time over the whole run: {busy}; recorded {lay.get('recorded', '?')}, "
                  f"n={lay['rows'][1]['vs_previous']['n'] if len(lay['rows']) > 1 else '?'} repetitions; "
                  f"load average at its start {tuple(round(x, 1) for x in lay.get('load_avg_at_start', ()))}, "
                  f"at its end {tuple(round(x, 1) for x in lay.get('load_avg_at_end', ()))})", "",
                  "| row | MegaScale (MFU points) | emulation judges it | tokens/s | MFU (of emulated peak) "
                  "| vs previous row [95% CI] | host share (worst rank) | optimizer state / rank |",
                  "|---|---:|---|---:|---:|---|---:|---:|"]
        for r in lay["rows"]:
            vs = stats.fmt(r["vs_previous"]) if "vs_previous" in r else "-"
            out = " **out of the accelerator regime: not quotable**" if r["host_share"] > HOST_SHARE_LIMIT else ""
            lines.append(f"| {r['row']} | {r['megascale_mfu_gain']} | {JUDGED.get(r['row'], '?')} "
                         f"| {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {vs} | {r['host_share']:.2f}{out} "
                         f"| {r['optimizer_state_bytes'] / 2**20:.2f} MiB |")
        together = [r for r in lay["rows"] if "vs_no_overlap" in r]
        if together:
            lines += ["", f"Every communication overlap of this layout together ({together[0]['row']} and the "
                      f"overlap rows above it) over none: {stats.fmt(together[0]['vs_no_overlap'])}."]
        lines.append("")
    return "\n".join(lines)


TRACE = harness.results_path("overlap_trace_emulated")
OVERLAP = harness.results_path("ablation_emulated_overlap")
OVERLAP_REPS = 36  # `--overlap`: the quick mode's three rows, with this many repetitions


def overlap_note() -> str:
    """DP and PP overlap measured on their own (`bench_ablation --emulated --overlap`), if that was run."""
    if not OVERLAP.is_file():
        return "(`python -m benchmarks.bench_ablation --emulated --overlap` not run.)"
    res = harness.read_result(OVERLAP)
    lay = res["layouts"][0]
    rows = {r["row"]: r for r in lay["rows"]}
    line = quick_line(res)
    return (f"**DP and PP overlap on their own** (`python -m benchmarks.bench_ablation --emulated --overlap`: "
            f"{lay['layout']}, only the three rows none / DP overlap / DP + PP overlap, {res['size']['reps']} "
            f"rotated repetitions, `{lay.get('spec', res['spec'])}`, the same links): DP overlap over none "
            f"{stats.fmt(rows['+ DP overlap']['vs_previous'])}; PP overlap over DP overlap alone "
            f"{stats.fmt(rows['+ PP overlap']['vs_previous'])}; both over none "
            f"{stats.fmt(rows['+ PP overlap']['vs_no_overlap'])}; host share (worst rank) at most "
            f"{line['host_share_max']:.2f}; load average {tuple(round(x, 1) for x in lay['load_avg_at_start'])} "
            f"at its start, {tuple(round(x, 1) for x in lay['load_avg_at_end'])} at its end; recorded "
            f"{lay['recorded']}. Raw: `benchmarks/results/ablation_emulated_overlap.json`." + earlier_overlap() +
            " PP overlap's gain is small by construction: what it can hide is the time the training thread is "
            "held in its pipeline sends without it, 55 ms of a 2.0 s step (2.7%) in the trace below, where PP "
            "overlap shortened the step by about 30 ms; the full ablation's paired intervals above are several "
            "per cent wide at its load, so its PP row cannot show that, while these 36 repetitions of three rows "
            "can when the machine is quiet. PP's wire is this small because an activation is 64 KiB per "
            "microbatch against ~100 MFLOP of a stage's forward (at real scale it is smaller still); a slower "
            "PP link would show more but would no longer be the DP-class link the model states.")


def earlier_overlap() -> str:
    """The same rows' earlier run under heavy load (kept), for the noise it shows."""
    f = OVERLAP.with_name("ablation_emulated_overlap_loaded.json")
    if not f.is_file():
        return ""
    res = harness.read_result(f)
    lay = res["layouts"][0]
    rows = {r["row"]: r for r in lay["rows"]}
    return (f" An earlier run of the same rows ({lay['recorded']}, load average {lay['load_avg_at_start'][0]:.0f} "
            f"at its start and {lay['load_avg_at_end'][0]:.0f} at its end, host share up to "
            f"{max(r['host_share'] for r in rows.values()):.2f}; `ablation_emulated_overlap_loaded.json`) gave DP "
            f"{stats.fmt(rows['+ DP overlap']['vs_previous'])} and PP "
            f"{stats.fmt(rows['+ PP overlap']['vs_previous'])}.")


def trace_note() -> str:
    """Where the DP time goes, from `benchmarks/overlap_trace_emulated.py`'s spans (if it was run)."""
    if not TRACE.is_file():
        return "(`python -m benchmarks.overlap_trace_emulated` not run: no trace summary.)"
    t = harness.read_result(TRACE)
    load = harness.machine_of(t)["load_avg_at_end"][0]
    parts, pp = [], []
    for r, v in sorted(t["ranks"].items(), key=lambda x: int(x[0])):
        off, on = v["overlap off"], v["overlap on"]
        parts.append(f"rank {r}: {on['issued_during_backward']}/{on['dp_grad_all_reduces']} issued during a "
                     f"backward with overlap ({off['issued_during_backward']}/{off['dp_grad_all_reduces']} "
                     f"without), last backward -> optimizer {1e3 * off['median_backward_end_to_optimizer_s']:.0f} "
                     f"-> {1e3 * on['median_backward_end_to_optimizer_s']:.0f} ms")
        dp_only = v.get("dp overlap only", {})
        if dp_only.get("median_pp_send_span_s") is not None:
            pp.append(f"rank {r} {1e3 * dp_only['median_pp_send_span_s']:.0f} ms of a "
                      f"{1e3 * dp_only['median_step_span_s']:.0f} ms step (with PP overlap the step spanned "
                      f"{1e3 * on['median_step_span_s']:.0f} ms)")
    return ("Where the time goes (`python -m benchmarks.overlap_trace_emulated`: the engine's own spans, as "
            f"MegaScan records them, of {t['steps']} steps of each of the pp=2 x dp=2 rows none / DP / DP + PP, load "
            f"{load:.0f}): " + "; ".join(parts) + ". With overlap every DP gradient all-reduce is "
            "issued while a backward task is on its device, and the gap from the last backward to the optimizer "
            "shrinks; it does not vanish because a stage's gradients are reduced only after its *final* "
            "microbatch's backward (they accumulate over microbatches, as in Megatron), and at these link speeds "
            "a stage's DP wire time is longer than that one backward: the rest stays exposed. Ranks 2 and 3 (the "
            "last stage) also wait there for stage 0's last backward (the gradient-norm all-reduce spans the "
            "pipeline), which is the 1F1B drain, not DP." + (
                " PP: without PP overlap every pipeline send is waited where it is issued; the training thread "
                "is held in those sends for " + ", ".join(pp) + " (median), which is all that PP overlap can "
                "give back here: the PP row's gain is bounded by that share of the step." if pp else ""))


def docs_body(result: dict[str, Any]) -> str:
    s, m = result["size"], harness.machine_of(result)
    return "\n".join([
        ("`python -m benchmarks.bench_ablation --emulated` runs the same cumulative rows as the CPU-bound table "
         "above on emulated devices: each of the 4 ranks has a modelled accelerator (`--emulate-device "
         f"{result['spec']}`: every task computes its real tensors, then the rank sleeps out the task's FLOPs "
         "at the device rate, so its host core is free) and every collective and P2P send takes its bytes over "
         "a modelled link (`parallel/link_model.py`, ring byte counts, one wire per group, serialised). Llama "
         f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, seq {s['seq']}, global batch "
         f"{s['global_batch']}, {s['microbatches']} microbatches per replica, DP buckets of {s['bucket_mb']} MB; "
         "rotated repetitions (their count, n, per layout below) after warm-up, paired ratios against the row "
         "above with a bootstrap 95% interval. MegaScale's \"+ communication overlap\" row is split into DP, PP and TP "
         "overlap, each measured against the row above (a row that changes nothing on a layout, PP overlap on "
         "tp=2 x dp=2 or TP overlap on pp=2 x dp=2, is left out), and all of a layout's overlap together is "
         "given against the last row without any. MFU is against the emulated peak (4 devices at the layout's "
         "rate). Host share: the worst rank's host wall time over its device time in that row's tasks (the run "
         "is in the accelerator regime below 0.5). tp=2 x dp=2 runs its devices and links at "
         f"1/{SLOWER.get('tp=2 x dp=2', 1.0):g} of pp=2 x dp=2's rates (the same ratio of wire to device time): "
         "every one of its ranks runs every layer's Python and the TP collectives on gloo inside the task's "
         "host compute, about twice pp=2 x dp=2's host work per device second: at the common rate it stayed "
         "out of the regime (host share 0.75-0.98, load 1-50), at half the rate it sat at the limit (0.42-0.57, "
         "load 31-45; kept in `benchmarks/results/ablation_emulated_tp_half_rate.json`)."), "",
        table(result),
        overlap_note(), "",
        ("Link speeds are set for communication's share of the step, not a real machine's GB/s: this model does "
         "~10^3 FLOPs per gradient byte where a large run does ~10^5, so at real link speeds the wire would be "
         "free. What the emulation judges: DP and PP overlap (wire time hidden behind device time) -- an "
         "optimistic bound, since a task's real compute runs at its start and its device time is slept after, "
         "so every DP bucket of a backward is issued early in it; ZeRO-1's memory (exact) and its parameter "
         "all-gather on the DP link; LAMB at 4x batch only as the amortisation of the bubble, optimizer and "
         "all-reduce over 4x tokens. What it cannot: TP overlap (the TP collectives run inside a task's host "
         "compute, which counts against its device time, so they are hidden with or without chunking; on a GPU "
         "they serialise with the GEMMs), the parallel block and the sliding window (device time is FLOPs over a "
         "rate; their gains are GEMM fusion, fewer launches and kernels that skip masked blocks), the data "
         "pipeline beyond ~1.0 (our embedded corpus builds a batch in under a millisecond)."), "",
        trace_note(), "",
        ("Rows marked not quotable (if any) ran with host time above half the device time: the host, not the "
         "emulated device, set the pace, so their ratios mean nothing for the accelerator regime. This 2-core "
         "machine is shared with other jobs (the load averages above): re-measure one layout with `--layout tp` "
         "(or `pp`), which replaces only that layout's record."), "",
        (f"Recorded {result['timestamp']}, torch {m['torch']}, load average at the end "
         f"{tuple(round(x, 2) for x in m['load_avg_at_end'])} (2 cores shared with other jobs), "
         f"{result['wall_s']} s. Raw step times: `benchmarks/results/ablation_emulated.json`."),
    ])
