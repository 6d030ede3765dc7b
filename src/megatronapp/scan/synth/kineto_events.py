"""The events of a GPU job's PyTorch profiler (Kineto) trace, as PyTorch 2.x with NCCL 2.2x writes them, from a
simulated rank's operations (gpu_kineto.py): `ProfilerStep#N`, `cpu_op`s around `cuda_runtime` launches, `ac2g`
flows from launch to kernel, kernels, memcpys, `record_param_comms` with the collective's args and the NCCL kernel
with the same args (as Kineto copies them), and `distributedInfo` with every process group of the rank."""
from __future__ import annotations

from typing import Any

US = 1_000  # ns per us
RANKS_PER_HOST = 8
_NCCL_ARGS = "(ncclDevKernelArgsStorage<4096ul>)"


def document(r: int, world: int, ops: list[Any], pgs: list, offset: int) -> dict:
    """Rank r's Kineto document from its simulated operations (gpu_kineto._Op: host and device times filled in),
    `pgs` the job's (description, ranks) process groups, `offset` its host's clock (ns)."""
    pid, tid = 1000 + r, 1000 + r
    ev: list[dict] = []
    corr = [r * 10_000_000]
    seqs: dict[int, int] = {}

    def us(ns: int) -> float:
        return round((ns + offset) / 1e3, 3)

    def x(cat: str, name: str, p: int, t: int, ts: int, end: int, args: dict) -> None:
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": p, "tid": t, "ts": us(ts),
                   "dur": round((end - ts) / 1e3, 3), "args": args})

    step_open: dict[int, int] = {}
    for op in ops:
        if op.kind == "step":
            if op.key == ("end",):
                x("user_annotation", op.name, pid, tid, step_open.pop(op.it), op.host_end + 10 * US,
                  {"External id": len(ev) + 1, "Record function id": 0, "Ev Idx": len(ev)})
            else:
                step_open[op.it] = op.host_ts
            continue
        if op.kind == "host":
            if op.name and op.host_ts >= 0:
                x("cpu_op", op.name, pid, tid, op.host_ts, op.host_end, {"External id": len(ev) + 1, "Ev Idx": len(ev)})
            continue
        if op.kind == "sync":
            if op.host_ts >= 0:
                x("cpu_op", op.name, pid, tid, op.host_ts, op.host_end, {"External id": len(ev) + 1, "Ev Idx": len(ev)})
                x("cuda_runtime", "cudaStreamSynchronize", pid, tid, op.host_ts + 5 * US, op.host_end - 2 * US,
                  {"External id": len(ev), "cbid": 131, "correlation": corr[0]})
                corr[0] += 1
            continue
        if op.host_ts < 0:
            continue  # never launched (its host stopped first)
        corr[0] += 1
        c, ext = corr[0], len(ev) + 1
        group_args: dict = {}
        if op.kind == "nccl":
            desc, members = pgs[op.pg]
            seqs[op.pg] = seqs.get(op.pg, 0) + 1
            group_args = {"Collective name": op.coll, "In msg nelems": op.nelems, "Out msg nelems": op.nelems,
                          "Group size": len(members), "dtype": op.dtype, "In split size": "[]",
                          "Out split size": "[]", "Process Group Name": str(op.pg), "Process Group Description": desc,
                          "Process Group Ranks": rank_string(members)}
            if op.coll == "send":
                group_args["Dst Rank"] = op.peer
            if op.coll == "recv":
                group_args["Src Rank"] = op.peer
            group_args["Seq"] = seqs[op.pg]
            cpu_args = {"External id": ext, "Record function id": 0, "Ev Idx": len(ev), **group_args,
                        "Rank": members.index(r), "Global rank start": members[0],
                        "Global rank stride": members[1] - members[0] if len(members) > 1 else 1,
                        "Is asynchronized op": 1}
            x("cpu_op", "record_param_comms", pid, tid, op.host_ts - 8 * US, op.host_end + 4 * US, cpu_args)
            name = {"send": "ncclDevKernel_SendRecv", "recv": "ncclDevKernel_SendRecv",
                    "allreduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL"}[op.coll] + _NCCL_ARGS
            launch = "cudaLaunchKernelExC"
        elif op.kind == "memcpy":
            x("cpu_op", op.cpu, pid, tid, op.host_ts - 6 * US, op.host_end + 3 * US,
              {"External id": ext, "Ev Idx": len(ev)})
            name, launch = op.name, "cudaMemcpyAsync"
        else:
            x("cpu_op", op.cpu, pid, tid, op.host_ts - 6 * US, op.host_end + 3 * US,
              {"External id": ext, "Ev Idx": len(ev), "Input Dims": [[4096, 4096], [4096, 4096]],
               "Input type": ["c10::BFloat16", "c10::BFloat16"]})
            name, launch = op.name, "cudaLaunchKernel"
        x("cuda_runtime", launch, pid, tid, op.host_ts, op.host_end,
          {"External id": ext, "cbid": 211, "correlation": c})
        ev.append({"ph": "s", "id": c, "pid": pid, "tid": tid, "ts": us(op.host_ts), "cat": "ac2g", "name": "ac2g"})
        if op.end < 0:
            continue  # launched, never finished: CUPTI records no kernel
        dev = {"External id": ext, "device": r % RANKS_PER_HOST, "context": 1, "stream": op.stream, "correlation": c}
        if op.kind == "memcpy":
            x("gpu_memcpy", name, r % RANKS_PER_HOST, op.stream, op.start, op.end,
              {**dev, "bytes": 4 << 20, "memory bandwidth (GB/s)": round((4 << 20) / max(op.end - op.start, 1), 3)})
        else:
            nc = op.kind == "nccl"
            x("kernel", name, r % RANKS_PER_HOST, op.stream, op.start, op.end,
              {"External id": ext, "queued": 0, "device": r % RANKS_PER_HOST, "context": 1, "stream": op.stream,
               "correlation": c, "registers per thread": 96 if nc else 168, "shared memory": 87568 if nc else 213008,
               "blocks per SM": 0.06 if nc else 2, "warps per SM": 1.1 if nc else 8,
               "grid": [8, 1, 1] if nc else [264, 1, 1], "block": [544, 1, 1] if nc else [384, 1, 1],
               "est. achieved occupancy %": 0 if nc else 12, **group_args})
        ev.append({"ph": "f", "id": c, "pid": r % RANKS_PER_HOST, "tid": op.stream, "ts": us(op.start), "cat": "ac2g",
                   "name": "ac2g", "bp": "e"})
    ev.append({"name": "process_name", "ph": "M", "ts": us(0), "pid": pid, "tid": 0, "args": {"name": "python3"}})
    ev.append({"name": "process_name", "ph": "M", "ts": us(0), "pid": r % RANKS_PER_HOST, "tid": 0,
               "args": {"name": "python3"}})
    pg_config = [{"pg_name": str(i), "pg_desc": desc, "backend_config": "cuda:nccl", "pg_size": len(m), "ranks": m}
                 for i, (desc, m) in enumerate(pgs) if r in m]
    return {"schemaVersion": 1, "deviceProperties": [{"id": r % RANKS_PER_HOST, "name": "NVIDIA H100 80GB HBM3",
                                                      "totalGlobalMem": 85045379072, "computeMajor": 9,
                                                      "computeMinor": 0, "numSms": 132}],
            "distributedInfo": {"backend": "nccl", "rank": r, "world_size": world, "pg_count": len(pg_config),
                                "pg_config": pg_config, "nccl_version": "2.21.5"},
            "record_shapes": 1, "with_stack": 0, "traceEvents": ev, "traceName": f"rank{r}.pt.trace.json",
            "displayTimeUnit": "ms", "baseTimeNanoseconds": offset}


def rank_string(ranks: list[int]) -> str:
    """`Process Group Ranks` as PyTorch writes it: past 30 ranks, the first 29, '...', the last."""
    shown = ranks if len(ranks) <= 30 else ranks[:29]
    tail = f", ..., {ranks[-1]}" if len(ranks) > 30 else ""
    return "[" + ", ".join(map(str, shown)) + tail + "]"
