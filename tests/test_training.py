"""Training end to end: loss goes down, resume is bit-exact, incomplete checkpoints are never loaded, bf16 and
recomputation train, a sharded checkpoint consolidates into one model."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from megatronapp.config import RunConfig
from megatronapp.data.dataset import BatchSource, build_batch_source, build_valid_source
from megatronapp.data.prefetch import DataWorkerError
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.launch import spawn
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.consolidate import load_model
from megatronapp.train.trainer import Trainer, run_rank
from tests.jobs import train_case as _cfg


def test_loss_goes_down_on_embedded_corpus(tmp_path):
    cfg = RunConfig.from_dict(_cfg(tmp_path, **{"train.steps": 40}))
    tr = Trainer(cfg)
    losses = [tr.train_step()["loss"] for _ in range(40)]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.5, f"loss did not fall enough: {first:.3f} -> {last:.3f}"


def _resume_worker(rank: int, world: int, root: str) -> None:
    root_p = Path(root)
    layout = {"parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "train.steps": 6}
    # a run that saves at step 3 and goes on; a second run resumes from that step-3 checkpoint
    # the straight run also evaluates (steps 3 and 6): the resumed run, which does not, must still match it
    run_rank(rank, world, _cfg(root_p / "straight", **{**layout, "train.save_interval": 3,
                                                        "train.tensorboard": str(root_p / "straight" / "tb"),
                                                        "train.eval_interval": 3, "train.eval_iters": 2}))
    resumed = _cfg(root_p / "resumed", **layout)
    resumed["train"]["resume"] = str(root_p / "straight" / "checkpoints" / "step_00000003")
    run_rank(rank, world, resumed)
    run_rank(rank, world, _cfg(root_p / "bf16", **{**layout, "train.steps": 3, "train.dtype": "bf16",
                                                    "train.recompute": "full"}))
    run_rank(rank, world, _cfg(root_p / "selective", **{**layout, "train.steps": 3,
                                                         "train.recompute": "selective"}))
    _reader_probe(rank, root_p, layout)


def _reader_probe(rank: int, root: Path, layout: dict) -> None:
    """Two steps under NCCL's rules, prefetching or not: which steps this rank read, and the batches the
    executor got (one reader per TP group: the others receive the reader's broadcast)."""
    from megatronapp.parallel import comm

    out = {}
    for prefetch in (2, 0):
        comm.reset()
        cfg = RunConfig.from_dict(_cfg(root / "reader", **{**layout, "parallel.comm_semantics": "nccl",
                                                           "train.data_prefetch": prefetch}))
        out[prefetch] = _probe_reads(Trainer(cfg, rank))
    torch.save(out, root / f"reader_rank{rank}.pt")


def _probe_reads(tr: Trainer) -> dict:
    read, fed = [], []
    get, step = tr.data.get, tr.executor.step

    def counted_get(k):
        read.append(k)
        return get(k)

    def recorded_step(mbs, **kw):
        fed.append([torch.cat(x) for x in zip(*mbs)])
        return step(mbs, **kw)

    tr.data.get, tr.executor.step = counted_get, recorded_step
    losses = [tr.train_step()["loss"] for _ in range(2)]
    started = tr.prefetcher is not None and tr.prefetcher.alive
    tr.close()
    stopped = not any(t.name.startswith("data-prefetch") for t in threading.enumerate())
    return {"read": read, "fed": fed, "losses": losses, "tp": tr.topo.coord.tp, "started": started,
            "stopped": stopped}


@pytest.mark.slow
def test_resume_is_bit_exact_and_modes_train(tmp_path):
    spawn(_resume_worker, 4, str(tmp_path))
    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert all(r["data_s"] >= 0 for r in straight + resumed)
    # TensorBoard holds the metrics.jsonl numbers under Megatron-LM's / torchtitan's tag names
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatronapp.train.tensorboard import TAGS

    events = EventAccumulator(str(tmp_path / "straight" / "tb")).Reload()
    assert {"loss", "lr", "grad_norm", "mfu", "throughput/tokens_per_s", "memory/peak_bytes", "time/data_s",
            "time/wait_s"} <= set(events.Tags()["scalars"])
    for key, tag in TAGS.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-12)) for r in straight if key in r], tag
    # one reader per TP group (tp=2 x pp=2, NCCL rules): TP rank 0 reads, its peer gets the same rows by
    # broadcast; prefetched or not, every rank's executor got exactly the batch of each step
    src, _ = build_batch_source(RunConfig.from_dict(_cfg(tmp_path / "x")), 0)
    for rank in range(4):
        probe = torch.load(tmp_path / f"reader_rank{rank}.pt")
        for prefetch, got in probe.items():
            if got["tp"] == 0:
                assert got["read"][:2] == [0, 1] and len(got["read"]) <= 2 + prefetch, (rank, prefetch)
            else:
                assert got["read"] == [], f"rank {rank} (TP rank 1) read data itself"
            for k, (ids, labels) in enumerate(got["fed"]):
                want = src.get(k)
                assert torch.equal(ids, want[0]) and torch.equal(labels, want[1]), (rank, prefetch, k)
        assert probe[2]["losses"] == probe[0]["losses"]
        assert probe[2]["started"] == (probe[2]["tp"] == 0) and probe[2]["stopped"], rank
    a = ckpt.resolve(tmp_path / "straight" / "checkpoints" / "latest")
    b = ckpt.resolve(tmp_path / "resumed" / "checkpoints" / "latest")
    for rank in range(4):
        sa, sb = ckpt.load_rank(a, rank), ckpt.load_rank(b, rank)
        for ca, cb in zip(sa["chunks"], sb["chunks"]):
            for name in ca:
                assert torch.equal(ca[name], cb[name]), f"rank {rank} {name} differs after resume"
        assert sa["step"] == sb["step"] == 6
    # bf16 compute with fp32 master weights and full recomputation, and selective recomputation, train.
    fp32 = [r["loss"] for r in straight[:3]]
    for run in ("bf16", "selective"):
        got = [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert all(abs(x - y) < 0.05 for x, y in zip(got, fp32)), f"{run}: {got} vs fp32 {fp32}"
    # the tp=2 x pp=2 checkpoint consolidates into one model whose loss matches the run's last loss
    model = load_model(a)
    ids, labels = src.get(6)
    with torch.no_grad():
        loss = float(model(ids, labels=labels))
    assert 0 < loss < straight[0]["loss"]
    # validation: forward only over the held-out split on tp2 x pp2, equal to the consolidated model's loss on the
    # same two batches; in metrics.jsonl at the evaluated steps, summary.json (last and best), the loss plot
    assert [r["step"] for r in straight if "val_loss" in r] == [3, 6]
    valid = build_valid_source(RunConfig.from_dict(_cfg(tmp_path / "x")), 0, ByteTokenizer())
    with torch.no_grad():
        want = sum(float(model(*valid.get(i)[:1], labels=valid.get(i)[1])) for i in range(2)) / 2
    assert straight[5]["val_loss"] == pytest.approx(want, abs=1e-5)
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["val_loss"] == straight[5]["val_loss"]
    assert summary["best_val_loss"] == min(straight[2]["val_loss"], straight[5]["val_loss"])
    assert (tmp_path / "straight" / "loss.png").stat().st_size > 0
    # exported to Hugging Face, the tp2 x pp2 checkpoint loads in transformers with the engine's logits, and its
    # loss on the held-out batches is the run's last validation loss
    from transformers import AutoModelForCausalLM

    from megatronapp.train.export import export_hf
    from tests.hf_checks import assert_exported_matches

    hf = export_hf(a, tmp_path / "hf")
    assert_exported_matches(a, hf, "Today is Monday, so")
    hf_model = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        hf_loss = sum(float(torch.nn.functional.cross_entropy(hf_model(valid.get(i)[0]).logits.flatten(0, 1),
                                                              valid.get(i)[1].flatten())) for i in range(2)) / 2
    assert hf_loss == pytest.approx(straight[5]["val_loss"], abs=1e-4)
    # MegaScope serves the same sharded checkpoint (consolidated into one model)
    from megatronapp.scope.cli import _from_checkpoint

    sm = _from_checkpoint(tmp_path / "straight" / "checkpoints" / "latest")
    with torch.no_grad():
        assert float(sm.model(ids, labels=labels)) == loss


def _prefetch_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("data-prefetch") and t.is_alive()}


def test_data_worker_stops_when_training_fails_and_its_own_error_names_the_step(tmp_path, monkeypatch):
    before = _prefetch_threads()
    d = _cfg(tmp_path / "a", **{"model.num_layers": 2, "train.steps": 3})
    d["attach"] = ["tests.plugin_probe:fail_at_second_step"]
    with pytest.raises(RuntimeError, match="probe failure at step 1") as failed:
        run_rank(0, 1, d)
    # `failed` holds the traceback, so the trainer is still alive: only run_rank's clean-up can have stopped it
    assert failed.tb is not None and _prefetch_threads() == before, "a failed run left the data worker running"
    real_get = BatchSource.get

    def flaky(self, step):
        if step == 2:
            raise OSError("disk went away")
        return real_get(self, step)

    monkeypatch.setattr(BatchSource, "get", flaky)
    with pytest.raises(DataWorkerError, match="batch of step 2: OSError: disk went away"):
        run_rank(0, 1, _cfg(tmp_path / "b", **{"model.num_layers": 2, "train.steps": 4}))
    assert _prefetch_threads() == before
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 2  # steps 0 and 1 trained


def test_middle_pipeline_stages_read_no_data(tmp_path):
    # pp=3 built in one process (no collectives are needed on these paths): stage 1 neither embeds ids nor
    # computes the loss, so it gets placeholders and never touches the batch source; stage 0 reads
    cfg = RunConfig.from_dict(_cfg(tmp_path, **{"parallel.pp": 3, "model.num_layers": 3}))
    middle = Trainer(cfg, 1)
    middle.data.get = lambda step: pytest.fail(f"a middle stage read the batch of step {step}")
    assert middle._batch() == [(None, None)] * cfg.parallel.microbatches and middle.prefetcher is None
    first = Trainer(cfg, 0)
    ids, labels = first.data.get(0)
    got = first._batch()
    first.close()
    assert torch.equal(torch.cat([a for a, _ in got]), ids) and torch.equal(torch.cat([b for _, b in got]), labels)


def test_incomplete_checkpoint_is_never_loaded(tmp_path):
    cfg = RunConfig.from_dict(_cfg(tmp_path / "run", **{"train.steps": 2}))
    tr = Trainer(cfg)
    tr.train_step()
    good = tr.save()
    tr.train_step()
    newer = tr.save()
    # simulate a crash during the newer save: its marker never got written
    (newer / ckpt.MARKER).unlink()
    root = tmp_path / "run" / "checkpoints"
    assert ckpt.resolve(root) == good
    assert ckpt.resolve(tmp_path / "run") == good
    with pytest.raises(ckpt.CheckpointError, match="no COMPLETE marker"):
        ckpt.resolve(newer)
    shutil.rmtree(good)
    with pytest.raises(ckpt.CheckpointError, match="incomplete, skipped: step_00000002"):
        ckpt.resolve(root)


def test_corrupt_rank_file_is_named(tmp_path):
    cfg = RunConfig.from_dict(_cfg(tmp_path / "run", **{"train.steps": 1}))
    tr = Trainer(cfg)
    tr.train_step()
    d = tr.save()
    path = d / "rank00000.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="rank00000.pt is corrupt or truncated"):
        ckpt.load_rank(d, 0)


def test_resume_of_a_meta_that_disagrees_with_its_rank_files_is_refused(tmp_path):
    # Another layout is resharded (tests/test_reshard.py), but a sealed meta.json claiming a layout its rank
    # files were not written with (tp=2 over one rank file) would be cut wrongly: refused, naming the field.
    cfg = RunConfig.from_dict(_cfg(tmp_path / "run", **{"train.steps": 1}))
    tr = Trainer(cfg)
    tr.train_step()
    d = tr.save()
    other = _cfg(tmp_path / "run2", **{"parallel.microbatches": 2})
    other["train"]["resume"] = str(d)
    other_cfg = RunConfig.from_dict(other)
    other_cfg.parallel.vpp = 1
    meta = json.loads((d / "meta.json").read_text())
    meta["config"]["parallel"]["tp"] = 2
    (d / "meta.json").write_text(json.dumps(meta))
    sealed = __import__("hashlib").sha256((d / "meta.json").read_bytes()).hexdigest()
    (d / ckpt.MARKER).write_text(json.dumps({"meta_sha256": sealed}))  # meta.json is sealed by the marker
    with pytest.raises(ckpt.CheckpointError, match="parallel.tp=2"):
        Trainer(other_cfg)


@pytest.mark.slow
def test_torchrun_entry_point(tmp_path):
    """`torchrun -m megatronapp train` runs each rank in place (no local spawn) and rank 0 reports."""
    import subprocess
    import sys

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "-m", "megatronapp", "train", "--tp", "2", "--steps", "2",
           "--hidden", "64", "--layers", "2", "--global-batch", "4", "--seq-len", "16", "--no-progress",
           "--peak-tflops", "1", "--out", str(tmp_path / "run")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("final loss") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
