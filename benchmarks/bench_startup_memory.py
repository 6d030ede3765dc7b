"""Peak start-up memory of one rank building its model chunk: sharded initialisation against the former one.

Shape: Llama-3.2-1B (hidden 2048, 16 layers, 32 query / 8 kv heads, SwiGLU 8192, vocabulary 128256, tied
embeddings; 1.24 B parameters, fp32). A shape-only check: each chunk is built and initialised, never run.
A tp=8 rank needs no communication to build its chunk, so one process plays rank k of a TP group of 8
(torch.distributed.get_rank patched to k) instead of starting 8 processes.

Peer: the former initialisation, which drew every weight whole (`randn(full shape) * std`) and kept this rank's
slice; it is reproduced here by swapping `fill_normal_shard` for a function that does exactly that.
Each case runs in a fresh process; peak = ru_maxrss after building minus the RSS before building (imports
included in neither). Both paths must give the same weights: a SHA-256 over the chunk's parameters is compared.

Run: python -m benchmarks.bench_startup_memory          (writes benchmarks/results/startup_memory.json, docs)
     python -m benchmarks.bench_startup_memory --quick  (a small shape; writes nothing)
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks import harness

RESULTS = harness.results_path("startup_memory")
SECTION = "## Start-up memory per rank"
MIB = 2**20

LLAMA_1B = {"family": "llama", "vocab_size": 128256, "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
            "num_kv_heads": 8, "ffn_hidden_size": 8192, "tie_embeddings": True, "rope_theta": 500000.0}
QUICK = {"family": "llama", "vocab_size": 8192, "hidden_size": 256, "num_layers": 2, "num_heads": 8,
         "num_kv_heads": 8, "ffn_hidden_size": 768, "tie_embeddings": True}
# (tp, rank, path): the last rank of tp=8 holds the vocabulary's padding rows and draws the most of each stream.
CASES = [(1, 0, "whole"), (1, 0, "sharded"), (8, 0, "whole"), (8, 0, "sharded"), (8, 7, "whole"), (8, 7, "sharded")]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _whole_tensor_fill(out, full, dim, rank, std, gen, block_numel=None) -> None:
    """The former initialisation: the full weight in one tensor, then this rank's slice copied out of it."""
    import torch

    value = torch.randn(full, generator=gen) * std
    local = out.shape[dim]
    real = max(0, min(local, full[dim] - rank * local))  # rows past a padded vocabulary's real ones are zero
    out.zero_()
    out.narrow(dim, 0, real).copy_(value.narrow(dim, rank * local, real).contiguous())


def measure(shape: dict[str, Any], tp: int, rank: int, path: str) -> dict[str, Any]:
    """Build rank `rank`'s whole-model chunk at tensor-parallel size `tp` in this process; memory and a digest."""
    import torch

    from megatronapp.config import ModelConfig
    from megatronapp.model import init
    from megatronapp.model.transformer import build_model
    from megatronapp.parallel.topology import Group

    torch.set_num_threads(1)
    cfg = ModelConfig(**shape)
    group = Group("tp", tuple(range(tp))) if tp > 1 else None
    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch("torch.distributed.get_rank", return_value=rank))
    if path == "whole":
        patches.enter_context(mock.patch.object(init, "fill_normal_shard", _whole_tensor_fill))
    before = _rss_bytes()
    t0 = time.perf_counter()
    with patches:
        chunk = build_model(cfg, seed=0, tp_group=group)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    params = sum(p.numel() * p.element_size() for p in chunk.parameters())
    digest = hashlib.sha256()
    for name, p in chunk.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().numpy().data)
    return {"tp": tp, "rank": rank, "path": path, "params_mib": params / MIB,
            "startup_mib": (peak - before) / MIB, "build_s": seconds, "num_params": cfg.num_params(),
            "sha256": digest.hexdigest()}


def run_case(shape: dict[str, Any], tp: int, rank: int, path: str) -> dict[str, Any]:
    """`measure` in a fresh interpreter, so the peak RSS belongs to this case alone."""
    arg = json.dumps({"shape": shape, "tp": tp, "rank": rank, "path": path})
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_startup_memory", "--worker", arg], cwd=harness.ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> dict[str, Any]:
    """Every case of CASES on the 1B shape (or the quick one); pairs whole/sharded and checks equal weights."""
    clock = harness.Clock()
    shape = QUICK if quick else LLAMA_1B
    cases = [run_case(shape, *c) for c in CASES]
    by_key = {(c["tp"], c["rank"], c["path"]): c for c in cases}
    pairs = []
    for (tp, rank, path), c in by_key.items():
        if path == "sharded":
            whole = by_key[(tp, rank, "whole")]
            pairs.append({"tp": tp, "rank": rank, "params_mib": c["params_mib"],
                          "whole_mib": whole["startup_mib"], "sharded_mib": c["startup_mib"],
                          "sharded_over_whole": c["startup_mib"] / whole["startup_mib"],
                          "whole_s": whole["build_s"], "sharded_s": c["build_s"],
                          "same_weights": c["sha256"] == whole["sha256"]})
    return {"shape": shape, "num_params": cases[0]["num_params"], "cases": cases, "pairs": pairs,
            "timestamp": clock.timestamp, "machine": harness.machine(clock)}


def table(result: dict[str, Any]) -> str:
    """A Markdown table: peak start-up memory per rank, former (whole weights) vs sharded initialisation."""
    lines = ["| layout | rank | its parameters (MiB) | former init (MiB) | sharded init (MiB) | sharded/former "
             "| build s (former / sharded) | same weights |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for p in result["pairs"]:
        lines.append(f"| tp={p['tp']} | {p['rank']} | {p['params_mib']:.0f} | {p['whole_mib']:.0f} "
                     f"| {p['sharded_mib']:.0f} | {p['sharded_over_whole']:.3f} | {p['whole_s']:.1f} / "
                     f"{p['sharded_s']:.1f} | {'yes' if p['same_weights'] else 'NO'} |")
    return "\n".join(lines)


def docs_body(result: dict[str, Any]) -> str:
    """This benchmark's section of docs/benchmarks.md, below its title."""
    s, m = result["shape"], result["machine"]
    return "\n".join([
        ("`python -m benchmarks.bench_startup_memory` builds one rank's whole-model chunk of a Llama-3.2-1B shape "
         f"(hidden {s['hidden_size']}, {s['num_layers']} layers, {s['num_heads']} heads / {s['num_kv_heads']} kv "
         f"heads, SwiGLU {s['ffn_hidden_size']}, vocabulary {s['vocab_size']}, tied; "
         f"{result['num_params'] / 1e9:.2f} B parameters, fp32) and reports the peak RSS of building it (each case "
         "a fresh process; peak after building minus RSS before). Shape only: nothing is trained. A tp=8 rank is "
         "built by one process playing rank k of a group of 8. The peer is the former initialisation, which drew "
         "each weight whole and kept the rank's slice; the sharded one draws the same random stream in 4 MiB "
         "row blocks and keeps only its own part, so the weights are bit-identical (SHA-256 compared)."), "",
        table(result), "",
        ("At tp=8 the former path peaked while drawing the tied embedding: the whole table (1002 MiB) and its "
         "scaled copy at once, over three times the rank's parameters. The sharded path peaks at the parameters "
         "plus about 25 MiB (one block of the stream, its scaled copy, allocator slack). At tp=1 every whole weight "
         "is the rank's own and an unwritten parameter takes no memory yet, so the former temporaries fit under "
         "the final footprint and both peak at about the model. Parameters are allocated on the device the chunk "
         "runs on (`TransformerChunk(..., device=)`, as the trainer does), so "
         "a GPU rank holds no CPU copy of its chunk either; `device=\"meta\"` gives the shapes with no storage."),
        "",
        (f"Recorded {result['timestamp']} on {m['cpus']} CPUs ({m['processor']}), torch {m['torch']}. "
         "Raw: `benchmarks/results/startup_memory.json`. `tests/test_init_sharded.py` asserts the behaviour (no "
         "tensor larger than a block, peak within the shard plus a few blocks) on a smaller model."),
    ])


def write_docs(result: dict[str, Any], path: Path = harness.DOCS) -> None:
    """Replace (or append) this benchmark's section of docs/benchmarks.md, leaving other sections alone."""
    harness.write_section(path, SECTION, docs_body(result))


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "a small shape; writes nothing", from_json=True)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(**json.loads(args.worker))))
        return
    result = harness.read_result(RESULTS) if args.from_json else run(quick=args.quick)
    print(table(result))
    if not all(p["same_weights"] for p in result["pairs"]):
        raise SystemExit("the sharded initialisation changed the weights; nothing written")
    if args.quick:
        return
    harness.save(result, RESULTS, docs_body(result), section=SECTION)


if __name__ == "__main__":
    main()
