"""ZeRO-1 slices kept in a buddy's memory (`resilience/buddy.py`): in-place recovery with `--zero 1` takes a lost
rank's optimizer slice from the DP peer that keeps a copy of it, not from the disk.

- the double buffer hands out only a whole copy of the step asked for (an older one, or one half received, never);
- on real processes (gloo, dp3: buddy and ward differ) under native, nccl-lazy and nccl-eager: each rank holds
  exactly its ward's slice after every step, and a hand-over rebuilds a rank from its DP peer and its buddy;
- a supervised tp2 x pp2 x dp2 job with `--zero 1 --spares 1`, kill -9 of ranks mid-step: the healthy ranks keep
  their processes, the state comes from memory ("peer+buddy"), no step is computed again, and every loss, the
  final weights and optimizer slices equal an uninterrupted run's bit for bit. A kill in the update (after the
  commit, before the copy of that step) falls back to the checkpoint, saying why.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import RunConfig
from megatronapp.launch import spawn
from megatronapp.parallel import comm
from megatronapp.resilience import generations
from megatronapp.resilience.buddy import BuddyCopy, DoubleBuffer, held_key, parse_held
from megatronapp.resilience.handover import hand_over
from megatronapp.resilience.supervisor import Options, supervise
from megatronapp.train.checkpoint_read import encode
from megatronapp.train.loop import AfterStep
from megatronapp.train.trainer import Trainer, train
from tests import engine_cases as ec
from tests.inplace_checks import assert_bit_identical, assert_healthy_ranks_kept, caused, events


def _whole(buf: DoubleBuffer, step: int, fill: int) -> None:
    data = buf.begin(step, 2, 3, torch.device("cpu"))
    data.fill_(fill)
    buf.complete()


def test_the_double_buffer_refuses_an_older_copy_and_never_hands_out_a_half_received_one():
    buf = DoubleBuffer()
    with pytest.raises(LookupError, match="no copy"):
        buf.of(0)
    _whole(buf, 4, 1)
    assert buf.of(4).step == 4 and buf.of(4).desc == b"\x01\x01" and buf.of(4).data.tolist() == [1, 1, 1]
    buf.begin(5, 2, 3, torch.device("cpu")).fill_(2)  # step 5's copy on its way, cut off by a failure
    with pytest.raises(LookupError, match="of step 4, not of the last committed step 5"):
        buf.of(5)
    assert buf.of(4).data.tolist() == [1, 1, 1]  # the whole copy is untouched by the one being received
    buf.drop()
    with pytest.raises(RuntimeError, match="no buddy copy is being received"):
        buf.complete()
    _whole(buf, 5, 3)
    with pytest.raises(LookupError, match="of step 5, not of the last committed step 4"):
        buf.of(4)
    assert buf.of(5).data.tolist() == [3, 3, 3]


def test_a_held_report_is_read_as_two_bounded_numbers():
    assert parse_held(b"12 345") == (12, 345)
    for bad in (b"", b"12", b"12 x", b"-1 3", b"1 2 3", b"9" * 70 + b" 1"):
        assert parse_held(bad) is None, bad


class _Store(dict):
    """The few store calls the supervisor's choice makes."""

    def check(self, keys: list[str]) -> bool:
        return all(k in self for k in keys)

    def get(self, key: str) -> bytes:
        return self[key].encode()


class _Proc:
    def __init__(self, pid: int):
        self.pid = pid


def _job(tmp_path: Path, *flags: str) -> generations.GenerationJob:
    cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, *flags, "--out", str(tmp_path / "run")]))
    job = generations.GenerationJob(cfg, Options(spares=1, buddy_copy="--no-buddy-copy" not in flags),
                                    lambda _: None, tmp_path / "events.jsonl")
    job.store, job.step = _Store(), 7
    job.ranks = {r: _Proc(1000 + r) for r in range(job.world)}
    return job


def test_the_supervisor_takes_a_slice_from_memory_only_from_a_surviving_buddy_holding_the_last_committed_step(
        tmp_path):
    job = _job(tmp_path)  # tp2 x pp2 x dp2: rank 1 (DP0-PP0-TP1) is kept by rank 3 (DP1-PP0-TP1)
    assert job._memory_source([1]) == (None, "ZeRO-1: rank 3 holds no copy of rank 1's optimizer slice yet")
    job.store[held_key(1)] = "7 999"  # reported by a process that is no longer rank 3
    assert job._memory_source([1])[0] is None
    job.store[held_key(1)] = "6 1003"  # rank 3's copy is of step 6; step 7 committed
    source, why = job._memory_source([1])
    assert source is None and "of step 6, not of the last committed step 7" in why, why
    job.store[held_key(1)] = "7 1003"
    assert job._memory_source([1]) == ("peer+buddy", "")
    assert job._memory_source([1, 3]) == (None, "no DP peer of a lost rank survived")  # its buddy lost with it
    job.store[held_key(6)] = "7 1004"  # rank 6 (DP1-PP1-TP0) kept by rank 4: both recover in one generation
    assert job._memory_source([1, 6]) == ("peer+buddy", "")
    dp4 = _job(tmp_path, "--nproc", "16", "--dp", "4", "--global-batch", "8")  # DP peers 1, 3, 5, 7 at (pp0, tp1)
    dp4.store.update({held_key(1): "7 1003", held_key(3): "7 1005"})
    source, why = dp4._memory_source([1, 3])  # rank 5 holds the replicated state, but rank 1's buddy is rank 3
    assert source is None and "buddy" in why and "lost too" in why, why
    off = _job(tmp_path, "--no-buddy-copy")
    off.store[held_key(1)] = "7 1003"
    assert off._memory_source([1])[0] is None and "--no-buddy-copy" in off._memory_source([1])[1]
    lamb = _job(tmp_path, "--optimizer", "lamb")
    lamb.store[held_key(1)] = "7 1003"
    assert lamb._memory_source([1])[0] is None
    plain = _job(tmp_path, "--zero", "0")
    assert plain._memory_source([1]) == ("peer", "")


MODES = ("native", "nccl-lazy", "nccl-eager")


def _slice_bytes(tr: Trainer) -> tuple[bytes, bytes]:
    desc, tensors = encode(tr.optimizer.slice_state())
    return desc, b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def _worker(rank: int, world: int, out: str) -> None:
    comm.CONTEXT.stall_timeout_s = 20.0  # a stall is named after 20 s instead of hanging
    store = dist.distributed_c10d._get_default_store()
    result = {}
    for i, mode in enumerate(MODES):
        if i:
            ec.fresh_world(store, rank, world, f"mode{i}")
        cfg = RunConfig.from_dict(ec.base_case("gpt2", **{
            "parallel.dp": world, "parallel.zero": 1, "parallel.comm_semantics": mode, "parallel.microbatches": 2,
            "train.global_batch_size": 2 * world, "train.steps": 10, "model.num_layers": 2}))
        comm.reset()
        tr = Trainer(cfg, rank)
        reports: list[tuple[str, str]] = []
        buddy = BuddyCopy(tr, lambda k, v, sink=reports: sink.append((k, v)))
        for _ in range(3):  # the run loop's step_start hook copies the slice after the step before
            buddy.copy(tr.step)
            tr.train_step()
        buddy.copy(tr.step)
        held = buddy.buffer.of(tr.step)
        own = _slice_bytes(tr)
        # rank 1 loses its state; its DP peer (rank 0) and its buddy (rank 2) hand it over
        before = ([p.detach().clone() for p in tr.params], own)
        if rank == 1:
            tr.optimizer.inner.state.clear()
            with torch.no_grad():
                for p in tr.params:
                    p.zero_()
            tr.step = 0
        hand_over(tr, [1], AfterStep(3), buddy=buddy)
        restored = tr.step == 3 and all(torch.equal(a, b) for a, b in zip(before[0], tr.params)) and \
            _slice_bytes(tr) == before[1]
        result[mode] = {"held": [held.desc.hex(), held.data.numpy().tobytes().hex()], "own": [own[0].hex(),
                        own[1].hex()], "restored": restored, "reports": reports}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_each_rank_keeps_its_wards_slice_and_a_hand_over_restores_a_rank_under_every_comm_mode(tmp_path):
    world = 3  # dp3: a rank's buddy (next) and ward (previous) are different peers
    spawn(_worker, world, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for mode in MODES:
        for r in range(world):
            mine, ward = res[r][mode], res[(r - 1) % world][mode]
            assert mine["held"] == ward["own"], f"{mode}: rank {r} does not hold rank {(r - 1) % world}'s slice"
            assert mine["reports"][-1] == [f"ctl/buddy/{(r - 1) % world}", f"3 {mine['reports'][-1][1].split()[1]}"]
            assert [int(v.split()[0]) for _, v in mine["reports"]] == [0, 1, 2, 3], mine["reports"]
        assert res[1][mode]["restored"], f"{mode}: rank 1 was not restored from its peer and its buddy"
        assert res[0][mode]["own"] != res[1][mode]["own"], "the DP ranks' slices should differ (ZeRO-1)"


STEPS = 10
WORLD = 8
FLAGS = ["--nproc", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--steps", str(STEPS),
         "--save-interval", "5", "--async-save", "--layers", "2", "--hidden", "32", "--heads", "4", "--global-batch",
         "4", "--microbatches", "2", "--seq-len", "16", "--no-progress", "--peak-tflops", "1"]


def _cfg(out: Path, inject: list[str] = ()) -> RunConfig:
    cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, "--out", str(out)]))
    cfg.inject = list(inject)
    return cfg


def test_zero_ranks_killed_mid_step_take_their_slices_from_buddies_bit_identical(tmp_path):
    baseline = tmp_path / "baseline"
    train(_cfg(baseline))
    out = tmp_path / "run"
    drills = ["kill=1:2:forward",     # rank 1, DP0-PP0-TP1, in its forward: its buddy is rank 3 (DP1-PP0-TP1)
              "kill=6:4:backward",    # rank 6, DP1-PP1-TP0, in its backward: its buddy (DP0) is rank 4
              "kill=3:6:reduce",      # rank 3, in the gradient reduction: the buddy of rank 1's newcomer
              "kill=5:8:optimizer"]   # rank 5, in the update: step 9 committed, its copy not made: the disk
    logs: list[str] = []
    opts = Options(heartbeat_s=0.3, max_restarts=8, diagnose_on_restart=False, spares=1, hang_timeout_s=30.0,
                   form_timeout_s=60.0)
    summary = supervise(_cfg(out, drills), opts, logs.append)
    log = "\n".join(logs)
    assert summary["steps"] == STEPS and summary["restarts"] == 0, log
    failures, _ = caused(summary)
    assert [f["rank"] for f in failures] == [1, 6, 3, 5], log
    # (a formation failure, `caused`, is a "hang"; the drills here are kills)
    sources = [r["source"] for r in summary["inplace_recoveries"] if r["kind"] != "hang"]
    assert sources == ["peer+buddy", "peer+buddy", "peer+buddy", "disk"], log
    why = summary["inplace_recoveries"][-1]["why_disk"]
    assert "copy of rank 5's optimizer slice is of step 8, not of the last committed step 9" in why, why
    assert_healthy_ranks_kept(out)
    gens = [e for e in events(out) if e["event"] == "generation"]
    assert [g.get("why_disk") is not None for g in gens[1:]] == [False, False, False, True]
    # the rollback to checkpoint 5 computed steps 6 to 9 again; the buddy recoveries none
    assert_bit_identical(out, baseline, STEPS, WORLD, replayed=(6, 7, 8, 9))
